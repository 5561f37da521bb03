"""A stand-in gateway process for the no-orphan tests: it plans and supervises engines on
the fake machine, prints one JSON line once they are ready, then either serves until
SIGTERM (``--then serve``: handled like the real gateway, stop then exit 0) or fails with
an exception (``--then fail``: the try/finally of ``async with`` must stop the engines).

Run as ``python -m tests.support.fakes.gateway --model-path M --base-port P --then serve``
with the environment of ``machine_env``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

import uvloop

from velocity_fast.engines.detect import detect_gpus_async
from velocity_fast.engines.models import resolve_model
from velocity_fast.engines.plan import plan_engines
from velocity_fast.engines.supervisor import EngineSupervisor


async def main(ns: argparse.Namespace) -> int:
    detection = await detect_gpus_async()
    model = resolve_model(ns.model_path, interactive=False)
    plan = plan_engines(detection.gpus, model, base_port=ns.base_port, log_dir=ns.log_dir, tensor_parallel_size=ns.tp)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with EngineSupervisor(plan.specs, stop_grace=5.0) as sup:
        print(json.dumps({"kind": plan.kind, "pids": sup.pids()}), flush=True)
        if ns.then == "fail":
            raise RuntimeError("the gateway failed")
        await stop.wait()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--then", choices=("serve", "fail"), default="serve")
    sys.exit(uvloop.run(main(p.parse_args())))
