"""How many SSE tokens/s one sim engine process (one core) relays to many streams.

The sim engine runs in its own process at a time scale so high that its step loop
never sleeps: the figure is then what its CPU allows, not what the simulated GPU
allows. The client (this process, raw asyncio Protocols, counting token chunks with
bytes.count) keeps ``--streams`` completions streams open, each sending its next
request on the same keep-alive connection when the previous one ends.

Method: warm up, then count tokens over ``--duration`` seconds of wall time, and read
the engine's CPU time from /proc to report tokens per CPU-second of the engine
(= per core). Where the machine has two cores or more, engine and client are pinned
to different ones.

    python -m bench.sim_throughput [--streams 256] [--duration 5] [--json [FILE]]
    python -m bench.sim_throughput --smoke       # tiny counts: it runs, the figure means nothing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TOKEN_MARK = b'"text":"'
END_MARK = b"data: [DONE]\n\n\r\n0\r\n\r\n"
# --smoke: a run of a second or so (CI: tests/bench/); flags given still win.
SMOKE = {"streams": 16, "max_tokens": 32, "duration": 0.5, "warmup": 0.2}


class StreamClient(asyncio.Protocol):
    """One keep-alive connection that sends a streamed completion after another."""

    def __init__(self, request: bytes, counter: list[int], done_counter: list[int]) -> None:
        self.request = request
        self.counter = counter
        self.done_counter = done_counter
        self.tail = b""
        self.transport = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.tail + data
        self.counter[0] += buf.count(TOKEN_MARK) - self.tail.count(TOKEN_MARK)
        if buf.endswith(END_MARK):
            self.done_counter[0] += 1
            self.tail = b""
            self.transport.write(self.request)
        else:
            self.tail = buf[-(len(END_MARK) - 1) :]

    def connection_lost(self, exc) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args) -> dict:
    body = json.dumps(
        {"model": "bench", "prompt": "benchmark prompt " * 8, "max_tokens": args.max_tokens, "stream": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    blocks = args.streams * (-(-(40 + args.max_tokens) // 16) + 2)
    cmd = [
        sys.executable,
        "-m",
        "velocity_fast.sim",
        "--port",
        "0",
        "--model",
        "bench",
        "--max-num-seqs",
        str(args.streams),
        "--num-gpu-blocks",
        str(max(blocks, 512)),
        "--time-scale",
        str(args.time_scale),
    ]
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= 2 and not args.no_pin
    if pin:
        cmd = ["taskset", "-c", str(cores[0])] + cmd
        os.sched_setaffinity(0, {cores[1]})
    from velocity_fast.harness.procs import start, stop

    # SIGTERM to the engine if this dies.
    proc = start(
        cmd,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        death_signal=signal.SIGTERM,
    )
    try:
        line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline), 30)
        port = int(line.decode().rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        counter, done = [0], [0]
        clients = []
        for _ in range(args.streams):
            _, proto = await loop.create_connection(lambda: StreamClient(request, counter, done), "127.0.0.1", port)
            clients.append(proto)
        await asyncio.sleep(args.warmup)
        c0, d0, t0, cpu0, me0 = counter[0], done[0], time.perf_counter(), cpu_seconds(proc.pid), time.process_time()
        await asyncio.sleep(args.duration)
        c1, d1, t1, cpu1, me1 = counter[0], done[0], time.perf_counter(), cpu_seconds(proc.pid), time.process_time()
        lost = sum(1 for c in clients if c.lost.done())  # closed by the engine before the end
        for c in clients:
            c.transport.close()
    finally:
        stop(proc, 10.0)
    wall = t1 - t0
    cpu = cpu1 - cpu0
    tokens = c1 - c0
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "duration_s": round(wall, 3),
        "tokens": tokens,
        "requests_completed": d1 - d0,
        "streams_lost": lost,
        "tokens_per_s": round(tokens / wall, 1),
        "engine_cpu_fraction": round(cpu / wall, 3),
        "client_cpu_fraction": round((me1 - me0) / wall, 3),
        "tokens_per_engine_cpu_s": round(tokens / cpu, 1) if cpu > 0 else None,
        "pinned": pin,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument(
        "--time-scale",
        type=float,
        default=1e6,
        help="high enough that simulated step times vanish (default %(default)s)",
    )
    p.add_argument(
        "--no-pin", action="store_true", help="do not pin engine and client to their own cores (a busy shared machine)"
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the result as JSON to FILE (or stdout)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny counts (" + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + "): checks that it runs",
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    import uvloop

    res = uvloop.run(run(args))
    print(
        f"sim_throughput: {res['streams']} streams, {res['tokens_per_s']:.0f} SSE tokens/s relayed "
        f"({res['tokens']} in {res['duration_s']} s, {res['requests_completed']} requests), engine at "
        f"{res['engine_cpu_fraction'] * 100:.0f}% of one core = {res['tokens_per_engine_cpu_s']} tokens per "
        f"engine CPU-second (client at {res['client_cpu_fraction'] * 100:.0f}%)"
        + (f"; {res['streams_lost']} streams lost" if res["streams_lost"] else "")
    )
    if args.json == "-":
        print(json.dumps(res))
    elif args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
