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
        ep.pace, ep.pace_batch = pace, ep.inflight  # as fleet/health.py reads them: at the batch running
        scrape_engine(adm, ep, clock, ep.inflight, 0)
        bind()

    scrape(0.020)  # well within: slow start grows the limit by half
    assert ep.limit == 12
    scrape(0.031)  # past the need (and its tenth of slack): no growth
    scrape(0.031)
    assert ep.limit == 12 and adm.stats()["pace_cuts"] == 0
    scrape(0.040)  # far past it: cut by a quarter, counted
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
    clock.t += 6.0  # the next window: the last one's need still holds
    assert adm.stats()["pools"]["m"]["pace_need_ms"] == pytest.approx(36.0)
    clock.t += 5.0
    assert adm.stats()["pools"]["m"]["pace_need_ms"] is None
    adm.close()


def _scrape_full(adm, ep, clock, bind, pace, times=3):
    """``times`` scrapes of ``ep`` decoding at ``pace`` with all it holds running, each
    followed by binding what admission granted since."""
    for _ in range(times):
        ep.pace, ep.pace_batch = pace, ep.inflight
        scrape_engine(adm, ep, clock, ep.inflight, 0)
        bind()


def _solo(adm, ep, clock, pace):
    """A scrape of ``ep`` decoding at ``pace`` while it ran one sequence at most."""
    ep.pace, ep.pace_batch = pace, 1.0
    scrape_engine(adm, ep, clock, 1, 0)


@pytest.mark.timeout(10)
async def test_a_need_no_batch_meets_is_never_cut():
    """The finding's case: 200 tokens within 3 s need 13.5 ms a token, an engine that
    takes 20 ms alone cannot give it at any batch: the limit is neither cut nor held."""
    clock = Clock()
    adm, (ep,) = make(limit=64, clock=clock, aimd_initial=8)
    one = await adm.admit(Ticket(sla_ms=3000, max_tokens=200))  # granted before any pace is known
    one.bind(ep)
    assert adm.stats()["pools"]["m"]["pace_need_ms"] == pytest.approx(13.5)
    for _ in range(5):  # one request at a time: 20 ms a token, 48 % past its need
        _solo(adm, ep, clock, 0.020)
    assert ep.limit == 8 and adm.stats()["pace_cuts"] == 0
    assert adm.stats()["endpoints"]["e0"]["solo_pace_ms"] == pytest.approx(20.0)
    one.release("completed")
    clock.t += 11.0  # that need forgotten (two windows on)
    # Such needs are not noted now that the solo pace is known, and a flood of them grows
    # the limit as any other work does, a fuller batch's slower pace notwithstanding.
    tasks, bound, bind = await _flood(adm, ep, lambda: Ticket(sla_ms=3000, max_tokens=200))
    assert adm.stats()["pools"]["m"]["pace_need_ms"] is None
    _scrape_full(adm, ep, clock, bind, 0.022)
    assert ep.limit > 8 and adm.stats()["pace_cuts"] == 0
    await _drain(tasks, bound)
    adm.close()


@pytest.mark.timeout(10)
async def test_a_need_some_batch_meets_is_still_cut_and_not_masked_by_one_none_meets():
    clock = Clock()
    adm, (ep,) = make(limit=64, clock=clock, aimd_initial=8)
    adm.stats()  # (admission's view of the endpoint made before its first scrape)
    _solo(adm, ep, clock, 0.020)
    mixed = iter([200, 100] * 20)  # 13.5 ms a token (none meets it) and 27 ms (alone: 20 ms)
    tasks, bound, bind = await _flood(adm, ep, lambda: Ticket(sla_ms=3000, max_tokens=next(mixed)))
    assert adm.stats()["pools"]["m"]["pace_need_ms"] == pytest.approx(27.0)
    ep.pace, ep.pace_batch = 0.040, ep.inflight  # a full batch at 40 ms: a smaller one helps
    scrape_engine(adm, ep, clock, ep.inflight, 0)
    assert ep.limit == 6 and adm.stats()["pace_cuts"] == 1
    await _drain(tasks, bound)
    adm.close()


@pytest.mark.timeout(10)
async def test_an_idle_engine_admits_a_burst_as_after_a_restart():
    async def burst_after(quiet_s, cut):
        clock = Clock()
        adm, (ep,) = make(limit=32, clock=clock, aimd_initial=8)
        adm.stats()  # (admission's view of the endpoint made before its first scrape)
        scrape_engine(adm, ep, clock, 0, 0)
        if cut:  # a full KV cache at every staleness window: cut to the minimum
            for _ in range(12):
                ep.kv_usage = 0.99
                clock.t += 1.0
                scrape_engine(adm, ep, clock, 1, 0)
            ep.kv_usage = 0.0
            assert ep.limit == 1
        waited = 0.0
        while waited < quiet_s:  # scrapes of an engine with nothing running
            clock.t += 0.9
            waited += 1.0
            scrape_engine(adm, ep, clock, 0, 0)
        tasks, bound, _ = await _flood(adm, ep, lambda: Ticket(sla_ms=3000, max_tokens=32), n=24)
        at_once = len(bound)
        await _drain(tasks, bound)
        adm.close()
        return at_once

    fresh = await burst_after(0, cut=False)
    assert fresh == 8
    assert await burst_after(60, cut=True) == fresh  # a quiet minute after the cuts
    assert await burst_after(5, cut=True) == 1  # not after a pause of a few seconds


@pytest.mark.timeout(10)
async def test_a_need_only_a_near_solo_engine_meets_holds_no_limit():
    """The policy bench with its clients' mix (30 % send no max_tokens): the reply length
    the pool learned, about 128 tokens, within a 3 s SLA needs 19 ms a token of an engine
    that takes 20 ms alone. Held to one or two sequences for such needs, dynamic's engines
    ran 6-7 each, its throughput halved and its share within the SLA fell to static's.
    Such a need neither holds nor cuts: the limit grows at a fuller batch's pace."""
    clock = Clock()
    adm, (ep,) = make(limit=64, clock=clock, aimd_initial=8)
    adm.stats()
    _solo(adm, ep, clock, 0.020)
    tasks, bound, bind = await _flood(adm, ep, lambda: Ticket(sla_ms=3000, max_tokens=142))
    assert adm.stats()["pools"]["m"]["pace_need_ms"] is None  # 19 ms: within 1.25x of solo, by HOLD's tenth
    _scrape_full(adm, ep, clock, bind, 0.023)
    assert ep.limit > 8 and adm.stats()["pace_cuts"] == 0
    await _drain(tasks, bound)
    adm.close()
