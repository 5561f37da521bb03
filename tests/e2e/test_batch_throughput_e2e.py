"""Batch work near full speed: with only `low` work, whose band has no deadline by default,
`dynamic` serves most of what `static` serves.

Two sim engines of 16 sequences the gateway is not told about, `velocityllm serve` with
nothing but `--policy`; 300 `low` clients each keep one 200-token request in flight and,
when declined, wait what Retry-After says. Requests per second are counted over a window
after the engines have filled. Asserted both ways: `dynamic` serves at least 0.7x what
`static` serves (0.75x here: the low band's ceiling of 0.8 keeps a fifth of each batch for
higher bands; the goal of 0.9x is open), and `static` itself is the engines' full batches at work (so the load
is real), not a figure a broken baseline pulled down.
"""
from __future__ import annotations

import asyncio
import tempfile
import time

import orjson
import pytest

from velocity_fast.loadgen.client import Client
from velocity_fast.loadgen.isolation import MODEL, Fleet

pytestmark = [pytest.mark.e2e]

# 4x real time: a 200-token request takes about 1.1 s at a full batch of 16.
SIM = ("--time-scale", "4", "--decode-tps", "50", "--batch-contention", "0.005")
TOKENS = 200
CLIENTS = 300


def low_wire(port: int) -> bytes:
    data = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a long report"}],
                         "max_tokens": TOKENS, "ignore_eos": True})
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\nx-velocity-priority: low\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


async def served_per_second(policy: str, fill_s: float = 6.0, window_s: float = 12.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="batch-") as logs:
        fleet = Fleet([["--max-num-seqs", "16"]] * 2, policy, logs, sim_base=SIM)
        fleet.start()
        try:
            await fleet.wait_ready()
            client = Client("127.0.0.1", fleet.port, timeout=120)
            data = low_wire(fleet.port)
            done: list[float] = []
            counts = {"declined": 0, "failed": 0}
            stop_at = time.monotonic() + fill_s + window_s

            async def worker(i: int) -> None:
                while time.monotonic() < stop_at:
                    r = await client.send(i, data)
                    if r.ok:
                        done.append(time.monotonic())
                    elif r.status in (429, 503):
                        counts["declined"] += 1
                        await asyncio.sleep(r.retry_after if r.retry_after is not None else 1.0)
                    else:
                        counts["failed"] += 1
                        await asyncio.sleep(0.1)

            t0 = time.monotonic()
            workers = [asyncio.create_task(worker(i)) for i in range(CLIENTS)]
            try:
                await asyncio.sleep(fill_s)
                stats = await fleet.stats()
                await asyncio.sleep(window_s)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                client.close()
        finally:
            fleet.stop()
    start = t0 + fill_s
    n = sum(start <= t <= start + window_s for t in done)
    eps = stats.get("admission", {}).get("endpoints", {})
    return {"policy": policy, "rps": n / window_s, **counts,
            "inflight": {k: e["inflight"] for k, e in eps.items()},
            "batch": {k: e["batch_capacity"] for k, e in eps.items()}}


@pytest.mark.timeout(180)
async def test_low_work_alone_is_served_by_dynamic_at_least_seven_tenths_of_static():
    dyn = await served_per_second("dynamic")
    sta = await served_per_second("static")
    print(f"\ndynamic {dyn}\nstatic  {sta}\nratio {dyn['rps'] / sta['rps']:.2f}")
    assert dyn["failed"] == sta["failed"] == 0
    # Low work has no deadline: none of it is declined on a prediction.
    assert dyn["declined"] == 0, dyn
    # static runs both engines' full batches: 32 requests of 200 tokens at 50 tokens/s per
    # sequence (4x time): about 28/s; at least half of that, or the load was not real.
    assert sta["rps"] >= 14.0, sta
    # 0.9x was the goal (low at ceiling 0.95); at 0.95 the isolation matrix's high band
    # missed its 1.5x on engines of 8 and 16, so low keeps 0.8 and serves 0.75x here.
    assert dyn["rps"] >= 0.7 * sta["rps"], (dyn, sta)
