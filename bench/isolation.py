"""Priority isolation: does `high` traffic keep its latency while `low` floods?

Method
------
* For each policy (default: dynamic, then static) a fresh ``velocityllm chargeVelocity
  --mock`` runs as a child process with 2 sim engines (32 running sequences each, 2x
  real time, 50 tokens/s per sequence) and ``--max-concurrency 32``.
* Idle: --high-samples short `high` streaming chat requests (24 tokens, ``ignore_eos``),
  one every --spacing seconds, each timed from writing the request to the last byte.
* Loaded: --low (default 512) `low` chat requests of 96 tokens are kept in flight all
  the time (each worker sends its next one as soon as the last answers), for
  --backlog seconds to let the gateway's queue fill, then the same `high` series is
  sent again while the flood goes on.
* Figure: p99 of the loaded series / p99 of the idle series, per policy. Target for
  `dynamic`: <= 1.25x (the low band may fill only 80% of each engine's slots, so a high
  request finds one free at once). `static` (one FIFO) shows what admission buys.
* The load is checked to be real: the requests queued in the gateway (admin /stats)
  and the number of low requests completed are reported.

Every process is on 127.0.0.1 and is stopped at the end, also on error or Ctrl-C.
Usage::

    python bench/isolation.py [--low 512] [--policies dynamic,static] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from velocity_fast.loadgen.client import Client  # noqa: E402
from velocity_fast.loadgen.gateway_proc import GatewayProcess  # noqa: E402
from velocity_fast.loadgen.report import write_json  # noqa: E402

TARGET = 1.25
SIM_ARGS = "--max-num-seqs 32 --time-scale 2 --decode-tps 50 --batch-contention 0.005"
HIGH_BODY = {"model": "velocity-sim", "messages": [{"role": "user", "content": "status?"}],
             "max_tokens": 24, "stream": True, "ignore_eos": True}
LOW_BODY = {"model": "velocity-sim", "messages": [{"role": "user", "content": "write a long essay"}],
            "max_tokens": 96, "ignore_eos": True}


def wire(port: int, body: dict, band: str) -> bytes:
    """The request bytes of one chat completion in ``band``."""
    data = orjson.dumps(body)
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\nx-velocity-priority: {band}\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    xs = sorted(xs)
    k = max(1, min(len(xs), int(-(-q * len(xs) // 100))))
    return xs[k - 1]


async def high_series(client: Client, port: int, n: int, spacing: float) -> tuple[list[float], int]:
    """n high streaming requests, one every ``spacing`` s; (latencies of the ok ones, failures)."""
    data = wire(port, HIGH_BODY, "high")

    async def one(i: int):
        await asyncio.sleep(i * spacing)
        r = await client.send(i, data)
        return (r.done - r.sent) if r.ok else None

    out = await asyncio.gather(*(one(i) for i in range(n)))
    ok = [x for x in out if x is not None]
    return ok, len(out) - len(ok)


def queued(stats: dict | None) -> int | None:
    """Requests waiting in the gateway's admission queues (static has one band for all)."""
    try:
        return int(stats["admission"]["queued"])
    except (TypeError, KeyError, ValueError):
        return None


async def measure(policy: str, args, log_dir: str) -> dict:
    """One policy: idle and loaded high series on a fresh gateway."""
    gw = GatewayProcess(policy, engines=2, log_path=os.path.join(log_dir, f"gw-{policy}.log"),
                        extra=["--max-concurrency", str(args.max_concurrency), "--sim-args", args.sim_args])
    gw.start()
    try:
        await gw.wait_ready(60)
        high = Client("127.0.0.1", gw.port, timeout=300)
        low = Client("127.0.0.1", gw.port, timeout=300)
        try:
            await high_series(high, gw.port, 4, 0.05)  # warm connections and the estimators
            idle, idle_failed = await high_series(high, gw.port, args.high_samples, args.spacing)

            low_wire = wire(gw.port, LOW_BODY, "low")
            stop_at = time.monotonic() + args.backlog + args.high_samples * args.spacing + 120.0
            stopping = asyncio.Event()
            counts = {"ok": 0, "failed": 0}

            async def low_worker(i: int) -> None:
                while not stopping.is_set() and time.monotonic() < stop_at:
                    r = await low.send(i, low_wire)
                    counts["ok" if r.ok else "failed"] += 1

            workers = [asyncio.create_task(low_worker(i)) for i in range(args.low)]
            try:
                await asyncio.sleep(args.backlog)
                before = await gw.stats()
                low_done_before = counts["ok"]
                t0 = time.monotonic()
                loaded, loaded_failed = await high_series(high, gw.port, args.high_samples, args.spacing)
                window = time.monotonic() - t0
                after = await gw.stats()
                low_done = counts["ok"] - low_done_before
            finally:
                stopping.set()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        finally:
            high.close()
            low.close()
    finally:
        gw.stop()
    p99_idle, p99_loaded = percentile(idle, 99), percentile(loaded, 99)
    return {
        "policy": policy,
        "idle_ms": {"p50": percentile(idle, 50) * 1000, "p99": p99_idle * 1000, "n": len(idle),
                    "failed": idle_failed},
        "loaded_ms": {"p50": percentile(loaded, 50) * 1000, "p99": p99_loaded * 1000, "n": len(loaded),
                      "failed": loaded_failed},
        "p99_ratio": p99_loaded / p99_idle,
        "p50_ratio": percentile(loaded, 50) / percentile(idle, 50),
        "gateway_queued": {"before": queued(before), "after": queued(after)},
        "low_completed_during_high_series": low_done,
        "low_rps_during_high_series": low_done / window if window > 0 else None,
        "low_failed": counts["failed"],
    }


async def main_async(args) -> int:
    runs = []
    with tempfile.TemporaryDirectory(prefix="isolation-") as log_dir:
        for policy in args.policies.split(","):
            res = await measure(policy.strip(), args, log_dir)
            runs.append(res)
            print(f"{res['policy']:<8} high p99 idle {res['idle_ms']['p99']:7.0f} ms  loaded "
                  f"{res['loaded_ms']['p99']:7.0f} ms  ratio {res['p99_ratio']:6.2f}x  (p50 ratio "
                  f"{res['p50_ratio']:.2f}x; queued {res['gateway_queued']['before']}, "
                  f"{res['low_rps_during_high_series']:.0f} low req/s)", flush=True)
    by = {r["policy"]: r for r in runs}
    head = (f"isolation bench: {args.low} concurrent low requests (96 tokens) against {args.high_samples} "
            f"high streaming requests (24 tokens, one every {args.spacing} s), 2 sim engines "
            f"[{args.sim_args}], --max-concurrency {args.max_concurrency}; figure = high p99 loaded / idle")
    lines = [head]
    for r in runs:
        lines.append(f"  {r['policy']:<8} {r['p99_ratio']:6.2f}x  ({r['idle_ms']['p99']:.0f} -> "
                     f"{r['loaded_ms']['p99']:.0f} ms; failed {r['idle_ms']['failed'] + r['loaded_ms']['failed']})")
    if "dynamic" in by:
        ok = by["dynamic"]["p99_ratio"] <= TARGET
        lines.append(f"  dynamic {'meets' if ok else 'MISSES'} the target <= {TARGET}x")
    if "dynamic" in by and "static" in by:
        lines.append(f"  static / dynamic loaded p99: "
                     f"{by['static']['loaded_ms']['p99'] / by['dynamic']['loaded_ms']['p99']:.1f}x")
    print("\n".join(lines))
    if args.json:
        write_json(args.json, {"args": vars(args), "target_dynamic_p99_ratio": TARGET, "runs": runs})
    failed = any(r["idle_ms"]["failed"] or r["loaded_ms"]["failed"] for r in runs)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="dynamic,static", help="comma-separated: dynamic, static, smart")
    p.add_argument("--low", type=int, default=512, help="low requests kept in flight")
    p.add_argument("--high-samples", type=int, default=100, help="high requests per series")
    p.add_argument("--spacing", type=float, default=0.1, help="seconds between high requests")
    p.add_argument("--backlog", type=float, default=3.0, help="seconds of flood before measuring")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--sim-args", default=SIM_ARGS)
    p.add_argument("--json", default=None, metavar="PATH", help="write the runs as JSON here")
    args = p.parse_args(argv)
    if args.low < 1 or args.high_samples < 1:
        p.error("--low and --high-samples must be at least 1")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
