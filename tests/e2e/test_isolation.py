"""Priority isolation end to end (issue: admission), asserted in both directions.

Two sim engines behind `chargeVelocity --mock`; at least 300 `low` requests kept in
flight all the time; short `high` streaming requests measured against their own idle
p99 on the same gateway. With `dynamic` the low band may fill only 80% of each
engine's slots, so a high request finds a free slot at once: its p99 stays within
1.5x of idle. With `static` (one FIFO, fixed concurrency) it waits behind the low
backlog: at least 10x worse — which also proves the load was real.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from velocity_fast.loadgen.client import Client
from velocity_fast.loadgen.gateway_proc import GatewayProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LOW_INFLIGHT = 320
HIGH_SAMPLES = 24
# Engines: 32 running sequences each, 2x real time. A low request (96 tokens) runs
# about a second; a high one (24 tokens) about 0.25 s when idle.
SIM_ARGS = "--max-num-seqs 32 --time-scale 2 --decode-tps 50 --batch-contention 0.005"


def _wire(port: int, body: dict, band: str) -> bytes:
    data = orjson.dumps(body)
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\nx-velocity-priority: {band}\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * len(xs) + 0.5)) - 1)]


async def _high_latencies(client: Client, port: int, n: int, spacing: float) -> list[float]:
    """n short high streaming requests, one every `spacing` seconds; their latencies."""
    body = {"model": "velocity-sim", "messages": [{"role": "user", "content": "status?"}],
            "max_tokens": 24, "stream": True, "ignore_eos": True}
    wire = _wire(port, body, "high")

    async def one(i: int) -> float:
        await asyncio.sleep(i * spacing)
        r = await client.send(i, wire)
        assert r.ok, (r.status, r.reason, r.error)
        return r.done - r.sent

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _measure(policy: str, tmp_path) -> tuple[float, float, dict]:
    gw = GatewayProcess(policy, engines=2, log_path=str(tmp_path / f"gw-{policy}.log"),
                        extra=["--max-concurrency", "32", "--sim-args", SIM_ARGS])
    gw.start()
    try:
        await gw.wait_ready(60)
        high = Client("127.0.0.1", gw.port, timeout=120)
        low = Client("127.0.0.1", gw.port, timeout=120)
        await _high_latencies(high, gw.port, 4, 0.05)  # warm up connections and estimators
        idle = await _high_latencies(high, gw.port, HIGH_SAMPLES, 0.12)

        low_body = {"model": "velocity-sim", "messages": [{"role": "user", "content": "write a long essay"}],
                    "max_tokens": 96, "ignore_eos": True}
        low_wire = _wire(gw.port, low_body, "low")
        stop_at = time.monotonic() + 90.0   # a bound on the load, whatever happens
        stopping = asyncio.Event()
        done_low = 0

        async def low_worker(i: int) -> None:
            nonlocal done_low
            while not stopping.is_set() and time.monotonic() < stop_at:
                r = await low.send(i, low_wire)
                done_low += r.ok

        workers = [asyncio.create_task(low_worker(i)) for i in range(LOW_INFLIGHT)]
        await asyncio.sleep(2.5)  # let the backlog build
        stats = await gw.stats() or {}
        loaded = await _high_latencies(high, gw.port, HIGH_SAMPLES, 0.12)
        after = await gw.stats() or {}
        stopping.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        high.close()
        low.close()
        return _p99(idle), _p99(loaded), {"stats": stats, "after": after, "low_completed": done_low}
    finally:
        gw.stop()


async def test_high_band_isolated_under_low_flood_dynamic_vs_static(tmp_path):
    idle_d, loaded_d, info_d = await _measure("dynamic", tmp_path)
    idle_s, loaded_s, info_s = await _measure("static", tmp_path)
    ratio_d = loaded_d / idle_d
    ratio_s = loaded_s / idle_s
    print(f"\nhigh p99 ratio to idle: dynamic {ratio_d:.2f}x ({idle_d * 1000:.0f} -> {loaded_d * 1000:.0f} ms), "
          f"static {ratio_s:.2f}x ({idle_s * 1000:.0f} -> {loaded_s * 1000:.0f} ms)")
    # The load was real: low requests queued in the gateway and kept completing.
    depth_low = info_d["stats"].get("admission", {}).get("bands", {}).get("low", {}).get("depth", 0)
    assert depth_low >= 100, info_d["stats"].get("admission")
    assert info_d["low_completed"] > 0 and info_s["low_completed"] > 0
    high_wait = info_d["after"].get("admission", {}).get("bands", {}).get("high", {}).get("wait_ms")
    assert ratio_d <= 1.5, f"dynamic: high p99 {ratio_d:.2f}x idle; high queue wait {high_wait}"
    assert ratio_s >= 10.0, f"static: high p99 only {ratio_s:.2f}x idle — the load is not real"
