"""Batch work near full speed: with only `low` work, whose band has no deadline by default,
`dynamic` serves nearly what `static` serves.

Two sim engines of 16 sequences the gateway is not told about, `velocityllm serve` with
nothing but `--policy`; 300 `low` clients each keep one 200-token request in flight and,
when declined, wait what Retry-After says. Requests per second are counted over a window
after the engines have filled. With no higher band asking, low borrows all of each
learned batch but a slot (15 of 16, `admission.borrow_after_ms`): 0.94x `static` here,
where its ceiling of 0.8 alone gave 0.75x. Asserted both ways: `dynamic` serves at least
0.85x what `static` serves (a margin for the machine's noise under 0.94x; above the 0.8x
that low's ceiling alone allows), and `static` itself is the engines' full batches at
work (so the load is real), not a figure a broken baseline pulled down. Then the other
side: high work arriving after low borrowed keeps its latency.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

import orjson
import pytest

from velocity_fast.loadgen.client import Client, frozen_heap
from velocity_fast.loadgen.isolation import LOW_BODY, MODEL, Fleet, high_series, noise, percentile, wire

pytestmark = [pytest.mark.e2e, pytest.mark.timed]  # throughput and latency ratios

# Engines whose batch their KV cache bounds, never a count: 256 blocks of 16 tokens hold
# about 18 of the low requests once each has decoded its 200 tokens.
KV_BOUND = [["--max-num-seqs", "256", "--num-gpu-blocks", "256"]] * 2
# Borrowing on KV-bound engines serves 1.31x what low's ceiling alone does (46.9 against
# 35.8 requests a second, each bound at the pace of the share of the cache it may fill,
# its peak up to 95 % of the cache; 1.10-1.14x while the peak was held at the pace's own
# share, in waves); asserted with a margin for the machine's noise.
BORROW_GAIN = 1.15

# 4x real time: a 200-token request takes about 1.1 s at a full batch of 16.
SIM = ("--time-scale", "4", "--decode-tps", "50", "--batch-contention", "0.005")
TOKENS = 200
CLIENTS = 300


def low_wire(port: int) -> bytes:
    data = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long report"}],
            "max_tokens": TOKENS,
            "ignore_eos": True,
        }
    )
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\nx-velocity-priority: low\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def served_per_second(
    policy: str, fill_s: float = 6.0, window_s: float = 12.0, engines=None, gateway_args: tuple = ()
) -> dict:
    with tempfile.TemporaryDirectory(prefix="batch-") as logs:
        fleet = Fleet(engines or [["--max-num-seqs", "16"]] * 2, policy, logs, sim_base=SIM, gateway_args=gateway_args)
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
    return {
        "policy": policy,
        "rps": n / window_s,
        **counts,
        "inflight": {k: e["inflight"] for k, e in eps.items()},
        "batch": {k: e["batch_capacity"] for k, e in eps.items()},
        "pace_ms": {k: e.get("pace_ms") for k, e in eps.items()},
        "pace_cuts": stats.get("admission", {}).get("pace_cuts"),
    }


@pytest.mark.timeout(180)
async def test_low_work_alone_borrows_the_engines_and_is_served_near_statics_rate():
    dyn = await served_per_second("dynamic")
    sta = await served_per_second("static")
    print(f"\ndynamic {dyn}\nstatic  {sta}\nratio {dyn['rps'] / sta['rps']:.2f}")
    assert dyn["failed"] == sta["failed"] == 0
    # Low work has no deadline: none of it is declined on a prediction.
    assert dyn["declined"] == 0, dyn
    # static runs both engines' full batches: 32 requests of 200 tokens at 50 tokens/s per
    # sequence (4x time): about 28/s; at least half of that, or the load was not real.
    assert sta["rps"] >= 14.0, sta
    # Borrowing: 15 of each engine's 16 run low work (its ceiling alone would hold 12).
    assert all(v == 15 for v in dyn["inflight"].values()), dyn
    # The gateway reads each engine's decode pace from its inter-token latency histogram
    # (about 5 ms a token at 50 tokens/s and 4x time), and cuts no limit for it: no
    # deadline work is running.
    assert all(p is not None and 1.0 < p < 50.0 for p in dyn["pace_ms"].values()), dyn
    assert dyn["pace_cuts"] == 0, dyn
    assert dyn["rps"] >= 0.85 * sta["rps"], (dyn, sta)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "engines, long, borrowed, back",
    [
        # 15 of each batch of 16 (low's ceiling alone: 12), back to 14 or fewer.
        ([["--max-num-seqs", "16"]] * 2, False, lambda e: e["inflight"] == 15, lambda e: e["inflight"] <= 14),
        # 200-token answers: the cache at its projected peak past low's share of it (0.8 of
        # 95 %: 0.76), back under it. Counts tell nothing here: bound evenly apart, the
        # requests low's share holds (about 19 an engine) are as many as borrowing holds.
        (KV_BOUND, True, lambda e: e["kv_peak"] > 0.78, lambda e: e["kv_peak"] <= 0.78),
    ],
    ids=["count-bound", "kv-bound"],
)
async def test_high_work_after_batch_borrowed_the_engines_keeps_its_latency(tmp_path, engines, long, borrowed, back):
    """Low work alone has borrowed all of each batch but a slot, or on KV-bound engines
    all the room their caches will have once their requests have decoded
    (admission.borrow_after_ms, 3 s here); then a high series arrives. The first high
    request finds a slot (or the blocks) free on every engine and ends the borrowing:
    high p95 stays within 1.5x of idle (times the run's own idle noise, as the isolation
    matrix judges)."""
    cfg = tmp_path / "borrow.yaml"
    cfg.write_text("admission:\n  borrow_after_ms: 3000\n")
    fleet = Fleet(engines, "dynamic", str(tmp_path), gateway_args=("--config", str(cfg)))
    fleet.start()
    try:
        with frozen_heap():
            await fleet.wait_ready()
            high = Client("127.0.0.1", fleet.port, timeout=120)
            low = Client("127.0.0.1", fleet.port, timeout=120)
            await high_series(high, fleet.port, 4, 0.05)
            idle_a, fa = await high_series(high, fleet.port, 30, 0.1)
            idle_b, fb = await high_series(high, fleet.port, 30, 0.1)
            data = low_wire(fleet.port) if long else wire(fleet.port, LOW_BODY, "low")
            stop = asyncio.Event()

            async def low_client(i: int) -> None:
                while not stop.is_set():
                    r = await low.send(i, data)
                    if not r.ok:
                        await asyncio.sleep(0.2)

            workers = [asyncio.create_task(low_client(i)) for i in range(200)]
            try:
                # Borrowing: each engine has run what the borrowed ceiling allows.
                seen: dict = {}
                deadline = time.monotonic() + 60.0
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    eps = (await fleet.stats()).get("admission", {}).get("endpoints", {})
                    for n, e in eps.items():
                        seen[n] = seen.get(n, False) or borrowed(e)
                    if seen and all(seen.values()):
                        break
                assert seen and all(seen.values()), (seen, eps)
                await asyncio.sleep(1.0)
                loaded, fl = await high_series(high, fleet.port, 30, 0.1)
                after = (await fleet.stats()).get("admission", {}).get("endpoints", {})
            finally:
                stop.set()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                high.close()
                low.close()
    finally:
        fleet.stop()
    assert fa == fb == fl == 0
    idle = idle_a + idle_b
    ratio = percentile(loaded, 95) / percentile(idle, 95)
    bound = 1.5 * min(noise(idle_a, idle_b), 1.5)
    print(
        f"\nborrowed then high: p95 {percentile(idle, 95) * 1000:.0f} -> {percentile(loaded, 95) * 1000:.0f} ms, "
        f"{ratio:.2f}x (bound {bound:.2f}x); in flight after {after and {n: e['inflight'] for n, e in after.items()}}"
    )
    assert ratio <= bound, (ratio, bound)
    # The borrowing ended with the first high request: low is back under its ceiling.
    assert all(back(e) for e in after.values()), after


@pytest.mark.timeout(240)
async def test_low_work_alone_borrows_what_a_kv_bound_cache_has_room_for(tmp_path):
    """On KV-bound engines the batch is never learned as a count, so low work alone used
    to keep its ceiling: the cache as it will be once its requests have decoded held
    below 0.76. An engine held by its cache is known by it: low borrows all of its room
    (the projection under 0.95) and is served faster than with borrowing off, and, bound
    evenly apart at the pace of that room, about as fast as ``static``, which overcommits
    the cache (the engines preempt and recompute; what puts high work 150x behind on
    these engines, bench/isolation.py --long --scenario kv-bound). Before the projected
    peak could pass the pace's share, batch work ran in waves and borrowing served
    0.80-0.82x ``static``. ``static`` runs every slot its limit gives it, so that the load
    is real."""
    off = tmp_path / "off.yaml"
    off.write_text("admission:\n  borrow_after_ms: 0\n")
    dyn = await served_per_second("dynamic", engines=KV_BOUND)
    held = await served_per_second("dynamic", engines=KV_BOUND, gateway_args=("--config", str(off)))
    sta = await served_per_second("static", engines=KV_BOUND)
    print(f"\nborrowing {dyn}\nceiling  {held}\nstatic   {sta}")
    assert dyn["failed"] == held["failed"] == sta["failed"] == 0
    assert dyn["declined"] == 0, dyn
    assert dyn["rps"] >= BORROW_GAIN * held["rps"], (dyn, held)
    assert dyn["rps"] >= 0.9 * sta["rps"], (dyn, sta)
    # The load is real: static keeps 32 requests on each engine, past what its cache holds.
    assert all(v >= 30 for v in sta["inflight"].values()), sta
