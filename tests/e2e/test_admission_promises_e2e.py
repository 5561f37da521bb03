"""Admission keeps its promises (Retry-After), end to end on real sockets and sim engines.

- What is admitted finishes within its SLA whatever the mix of sizes: a fresh `serve` in
  front of two sim engines, six short requests, then a burst of 30 parallel /generate
  of 60 tokens (low band, an explicit 2 s SLA); and with no warm-up a burst of 30 of 30
  tokens, which the gateway admits whole (BURST_TOKENS says why).
- A Retry-After that keeps its promise: a burst of 160 against 16 slots at a 2 s SLA
  (bench/retry_after.py); clients that retry when told are served within the SLA, those
  that come back at a tenth of it are not, and the times told span the burst's drain.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.bench import bench_module
from tests.support.gateway import gateway_process
from tests.support.sim import http_request, sim_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timed]  # SLAs met, times told

MODEL = "sim-model"


async def wait_ready(admin_port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = await http_request(admin_port, "GET", "/ready", timeout=2)
            if r.status == 200 and r.json()["healthy_endpoints"] == 2:
                return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("the gateway did not turn ready")


async def generate(port: int, max_tokens: int, sla_ms: str | None = "2000"):
    headers = {"x-velocity-priority": "low"}
    if sla_ms is not None:
        headers["x-velocity-sla-ms"] = sla_ms
    t0 = time.monotonic()
    r = await http_request(
        port,
        "POST",
        "/generate",
        {"prompt": "Write about the sea.", "max_tokens": max_tokens, "model": MODEL},
        headers,
        timeout=60,
    )
    return r, time.monotonic() - t0


# The burst's answer length. Warm, the gateway has learned the engines and declines what
# it predicts would miss the SLA: 60 tokens, most of the burst past what two engines finish
# in 2 s. Cold, nothing is learned and nothing predicted, so the gateway admits the whole
# burst, and what is judged is its own part (queueing, dispatch, the answer's way back):
# 30 tokens, which two default sims running all 30 at once finish in about 1.2 s. With 60
# the slowest answer took 1.83-1.99 s of the 2 s: a measure of the sim's speed, not of a
# promise the gateway made, and one a CPU-bound neighbour pushed past the SLA.
BURST_TOKENS = {True: 60, False: 30}


async def mixed_sizes(warm: bool) -> dict:
    with sim_engine(model=MODEL) as e1, sim_engine(model=MODEL) as e2:
        with gateway_process("serve", "--endpoint", f"e1={e1.url}={MODEL}", "--endpoint", f"e2={e2.url}={MODEL}") as gw:
            await wait_ready(gw.admin_port)
            if warm:
                for r, _ in await asyncio.gather(*(generate(gw.port, 16) for _ in range(6))):
                    assert r.status == 200, r.body
            answers = await asyncio.gather(*(generate(gw.port, BURST_TOKENS[warm]) for _ in range(30)))
            stats = (await http_request(gw.admin_port, "GET", "/stats")).json()["admission"]
    ok = [(r, t) for r, t in answers if r.status == 200]
    declined = [r for r, _ in answers if r.status != 200]
    assert all(r.status == 429 and r.headers["x-velocity-reject-reason"] == "sla" for r in declined), [
        (r.status, r.body[:200]) for r in declined
    ]
    within = [r for r, t in ok if t <= 2.0]
    print(
        f"\nwarm-up {warm}: admitted {len(ok)}, {len(within)} within 2 s (slowest "
        f"{max(t for _, t in ok):.2f} s); declined {len(declined)}; gateway sla {stats['sla']}"
    )
    return {"ok": ok, "within": within, "declined": declined, "stats": stats}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warm", [True, False], ids=["after-short-requests", "cold"])
async def test_what_is_admitted_finishes_within_its_sla_whatever_the_mix_of_sizes(warm):
    res = await mixed_sizes(warm)
    ok, within = res["ok"], res["within"]
    # The promise: at least 95 % of what is admitted finishes within its SLA, by the
    # client's clock and by the gateway's own count.
    assert len(within) >= 0.95 * len(ok), (len(within), len(ok))
    sla = res["stats"]["sla"]
    assert sla["missed"] <= 0.05 * (sla["met"] + sla["missed"]), sla
    # Not by declining everything: at least the slots a fresh gateway gives low work on two
    # engines whose batch it has not learned were used (0.7 of a limit of 8 each: 10; more
    # once slow start has seen them run all they were sent).
    assert len(ok) >= 8, len(ok)


@pytest.mark.timeout(240)
async def test_a_burst_told_when_to_retry_comes_back_within_its_sla_and_the_times_span_the_drain(tmp_path):
    ra = bench_module("retry_after")
    res = await ra.run(requests=160, seqs=8, sla_ms=2000.0, max_tokens=40, log_dir=str(tmp_path))
    print("\n" + ra.report(res))
    told, tenth = res["as_told"], res["at_a_tenth"]
    assert told["declined_sla"] >= 100 and told["retried"] == told["declined"], told
    # Clients that wait as told are served within the SLA; those that come back at a
    # tenth of it do at least 30 points worse.
    assert told["retry_ok_share"] >= 0.80, told
    assert tenth["retry_ok_share"] <= told["retry_ok_share"] - 0.30, (told, tenth)
    # The times told span the burst's drain time (successive, not one for all), and do
    # not send clients away far longer than the drain.
    assert res["span_of_drain"] >= 0.5, res
    assert told["told_s"]["max"] <= 1.5 * res["drain_s"], res
    assert told["told_s"]["distinct_ms"] >= 0.5 * told["declined"], told
