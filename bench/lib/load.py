"""The load client of the benchmarks: wrk where a benchmark needs a C client's rate and
the same load for every proxy, else the project's own HTTP client
(velocity_fast.loadgen.client: uvloop + httptools, keep-alive), driven closed-loop or
open-loop here.

``run_load`` runs one closed-loop run in a process of its own (wrk, or this module:
``python -m bench.lib.load PORT CONNECTIONS SECONDS``) and returns its figures;
``closed_loop`` and ``open_loop`` drive the client inside the calling process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

from velocity_fast.loadgen.client import Client, Result

from .bodies import BODY, PATH, STREAM_BODY
from .processes import child_setup
from .targets import CHILD_ENV, REPO

WRK_LUA = """\
wrk.method = "POST"
local f = assert(io.open("{path}", "rb"))
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  io.write(string.format(
    'OVERHEAD_JSON {{"requests":%d,"duration_s":%.6f,"non2xx":%d,"errors":%d,' ..
    '"p50_us":%.1f,"p99_us":%.1f,"mean_us":%.1f}}\\n',
    summary.requests, summary.duration / 1e6, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def wrk_cmd(work: Path, body: bytes = BODY) -> list[str] | None:
    """wrk (1 thread, 5 s timeout) with a script that POSTs ``body`` and prints its figures
    as one OVERHEAD_JSON line; None when wrk is not installed."""
    exe = shutil.which("wrk")
    if exe is None:
        return None
    name = "post" if body == BODY else "stream" if body == STREAM_BODY else f"body-{len(body)}-{zlib.crc32(body):08x}"
    script = work / f"{name}.lua"
    if not script.exists():
        # The body from a file, as its bytes: a JSON body's escapes would be Lua's in a literal.
        (work / f"{name}.body").write_bytes(body)
        script.write_text(WRK_LUA.format(path=work / f"{name}.body"))
    return [exe, "-t1", "--timeout", "5s", "-s", str(script)]


def run_load(
    client: str, work: Path, port: int, conns: int, duration: float, cpu: int | None, body: bytes = BODY
) -> dict:
    """One closed-loop load run in its own process; returns its figures and its own CPU seconds.
    ``client``: "wrk", or "python" (this module's client; it sends the small body only)."""
    if client == "wrk":
        argv = wrk_cmd(work, body) + [f"-c{conns}", f"-d{max(1, round(duration))}s", f"http://127.0.0.1:{port}{PATH}"]
        kw = {}
    else:
        argv = [sys.executable, "-m", "bench.lib.load", str(port), str(conns), str(duration)]
        kw = {"cwd": str(REPO), "env": dict(os.environ, **CHILD_ENV)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(argv, capture_output=True, timeout=duration + 30, preexec_fn=child_setup(cpu), **kw)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = p.stdout.decode(errors="replace")
    m = re.search(r"OVERHEAD_JSON (\{.*\})", out)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"load client failed ({p.returncode}): {out[-500:]} {p.stderr.decode()[-500:]}")
    r = json.loads(m.group(1))
    r["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return r


def post_wire(path: str, body: bytes) -> bytes:
    """A keep-alive POST of a JSON body, as bytes."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def closed_loop(
    port: int, clients: int, seconds: float, make_wire, *, think: float = 0.0, seed: int = 0, timeout: float = 30.0
) -> list[Result]:
    """``clients`` keep-alive clients, each sending its next request (``make_wire(rng)``,
    with a random.Random of its own) when the last is answered, for ``seconds``: every
    Result (status 0: no answer)."""
    results = []
    end = time.monotonic() + seconds

    async def one(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        client = Client("127.0.0.1", port, timeout=timeout)
        try:
            n = 0
            while time.monotonic() < end:
                results.append(await client.send(n, make_wire(rng)))
                n += 1
                if think:
                    await asyncio.sleep(think * rng.random() * 2)
        finally:
            client.close()

    await asyncio.gather(*(one(i) for i in range(clients)))
    return results


async def open_loop(
    port: int,
    rate: float,
    seconds: float,
    make_wire,
    *,
    seed: int = 0,
    connections: int = 64,
    on_tick=None,
    timeout: float = 30.0,
) -> tuple[list, int]:
    """Requests (``make_wire(rng)``) at ``rate`` per second for ``seconds`` over a pool of at
    most ``connections`` keep-alive connections (a request due while all are busy waits in
    the client for one, as behind any client's bounded pool), each answered or timed out:
    (every Result, with None for one that never finished, and the number sent).
    ``on_tick(seconds into the run)`` is called every 5 s."""
    rng = random.Random(seed)
    client = Client("127.0.0.1", port, timeout=timeout)
    slots = asyncio.Semaphore(connections)
    results = []
    tasks = set()
    t0 = time.monotonic()
    n = 0
    next_tick = t0 + 5.0

    async def one(i: int, data: bytes):
        async with slots:
            return await client.send(i, data)

    try:
        while True:
            now = time.monotonic()
            if now - t0 >= seconds:
                break
            due = int((now - t0) * rate) + 1
            while n < due:
                t = asyncio.ensure_future(one(n, make_wire(rng)))
                t.add_done_callback(lambda t: results.append(t.result()) if not t.cancelled() else None)
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                n += 1
            if on_tick is not None and now >= next_tick:
                on_tick(now - t0)
                next_tick += 5.0
            await asyncio.sleep(0.005)
        if tasks:
            await asyncio.wait(tasks, timeout=40.0)
    finally:
        client.close()
    return results + [None] * (n - len(results)), n


async def _closed_loop_figures(port: int, conns: int, duration: float) -> dict:
    """run_load's Python client: the small chat request over ``conns`` connections for
    ``duration`` s; the figures wrk's script prints, over the requests answered in time."""
    wire = post_wire(PATH, BODY)
    t0 = time.perf_counter()
    results = await closed_loop(port, conns, duration, lambda rng: wire, timeout=5.0)
    stop = t0 + duration
    answered = [r for r in results if r.status and r.done <= stop]
    lat = sorted(r.done - r.sent for r in results if r.status)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6 if lat else 0.0

    return {
        "requests": len(answered),
        "duration_s": duration,
        "non2xx": sum(not 200 <= r.status < 300 for r in answered),
        "errors": sum(r.status == 0 for r in results),
        "p50_us": pct(0.50),
        "p99_us": pct(0.99),
        "mean_us": (sum(lat) / len(lat) * 1e6) if lat else 0.0,
    }


def main(argv: list[str]) -> int:
    port, conns, duration = int(argv[0]), int(argv[1]), float(argv[2])
    try:
        import uvloop

        result = uvloop.run(_closed_loop_figures(port, conns, duration))
    except ImportError:
        result = asyncio.run(_closed_loop_figures(port, conns, duration))
    print("OVERHEAD_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
