"""Pace: an engine that decodes slower than the deadline work granted lately needs (its
inter-token latency over the last second, fleet/health.py) stops growing its limit, and
past a margin has it cut; deadline-free work sets no need (admission/controller.pyx)."""
import asyncio

import pytest

from tests.admission.test_admission import Clock, make, scrape_engine
from velocity_fast.admission.controller import Ticket


async def _flood(adm, ep, ticket, n=40):
    tasks = [asyncio.create_task(adm.admit(ticket())) for _ in range(n)]
    await asyncio.sleep(0)
    bound = []

    def bind():
        for t in tasks:
            if t.done() and t.result() not in bound:
                bound.append(t.result())
                t.result().bind(ep)

    bind()
    return tasks, bound, bind


async def _drain(tasks, bound):
    for le in bound:
        le.release("cancelled")
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.timeout(10)
async def test_an_engine_slower_than_deadline_work_needs_stops_growing_then_is_cut():
    clock = Clock()
    adm, (ep,) = make(limit=64, clock=clock, aimd_initial=8)
    # 100 tokens within 3 s: 27 ms a token at most (a tenth kept for the margin).
    tasks, bound, bind = await _flood(adm, ep, lambda: Ticket(sla_ms=3000, max_tokens=100))
    assert ep.limit == 8 and adm.stats()["pools"]["m"]["pace_need_ms"] == pytest.approx(27.0)

    def scrape(pace):
        ep.pace = pace
        scrape_engine(adm, ep, clock, ep.inflight, 0)
        bind()

    scrape(0.020)                      # well within: slow start grows the limit by half
    assert ep.limit == 12
    scrape(0.031)                      # past the need (and its tenth of slack): no growth
    scrape(0.031)
    assert ep.limit == 12 and adm.stats()["pace_cuts"] == 0
    scrape(0.040)                      # far past it: cut by a quarter, counted
    assert ep.limit == 9 and adm.stats()["pace_cuts"] == 1
    assert adm.stats()["endpoints"]["e0"]["pace_ms"] == pytest.approx(40.0)
    await _drain(tasks, bound)
    adm.close()


@pytest.mark.timeout(10)
async def test_deadline_free_work_grows_the_limit_whatever_the_pace():
    clock = Clock()
    adm, (ep,) = make(limit=64, clock=clock, aimd_initial=8)
    tasks, bound, bind = await _flood(adm, ep, lambda: Ticket(band="low", max_tokens=100))
    assert adm.stats()["pools"]["m"]["pace_need_ms"] is None
    ep.pace = 0.200
    scrape_engine(adm, ep, clock, ep.inflight, 0)
    assert ep.limit > 8 and adm.stats()["pace_cuts"] == 0
    await _drain(tasks, bound)
    adm.close()


@pytest.mark.timeout(10)
async def test_a_need_is_forgotten_two_windows_after_the_last_deadline_grant():
    clock = Clock()
    adm, (ep,) = make(limit=64, clock=clock)
    (await adm.admit(Ticket(sla_ms=2000, max_tokens=50))).release("completed")
    assert adm.stats()["pools"]["m"]["pace_need_ms"] == pytest.approx(36.0)
    clock.t += 6.0                     # the next window: the last one's need still holds
    assert adm.stats()["pools"]["m"]["pace_need_ms"] == pytest.approx(36.0)
    clock.t += 5.0
    assert adm.stats()["pools"]["m"]["pace_need_ms"] is None
    adm.close()
