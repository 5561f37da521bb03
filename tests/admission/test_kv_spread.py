"""Batch work on a KV-bound engine: the cache's real peak (kv_peak), what each request holds
besides its answer (kv_fixed), and batch requests bound one at a time (batch_interval), so
that a flood's low requests do not end together and hold every answer at once."""

import asyncio

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.saturation import EndpointLoad, observe_endpoint
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.fleet.endpoint import Endpoint, Pool

CACHE = 256 * 16


def _peak_by_steps(kv: float, left: list[float], answers: list[float]) -> float:
    """The cache's most, stepped token by token: every request adds one a step until it has
    none left, then frees its answer."""
    most = kv * CACHE
    for t in range(0, int(max(left)) + 1):
        held = kv * CACHE + sum(min(t, r) for r in left) - sum(m for r, m in zip(left, answers) if r < t)
        most = max(most, held)
    return most / CACHE


def _load(kv: float, at: float, pace: float) -> EndpointLoad:
    e = EndpointLoad(limit=256)
    e.observe(0, 0, kv, at)
    e.kv_tokens = CACHE
    e.pace = pace
    return e


def test_requests_bound_apart_peak_below_the_sum_of_their_answers():
    # Ten answers of 200 tokens, bound 0.4 s apart at 20 ms a token: at the scrape they
    # have 200, 180 ... 20 tokens left, and hold the 900 they decoded.
    e = _load(900 / CACHE, 10.0, 0.02)
    for i in range(10):
        e.bind_work(200.0, 10.0 - 0.4 * i, 1.0)
    left = [200.0 - 20 * i for i in range(10)]
    assert e.kv_peak() == pytest.approx(_peak_by_steps(900 / CACHE, left, [200.0] * 10))
    # As they end they free what they decoded: the peak is well under every answer whole.
    assert e.kv_peak() < (900 + sum(left)) / CACHE - 0.2
    # The sums see only the total coming.
    assert e.kv_ahead(10.0) == pytest.approx(sum(left) / CACHE)


def test_requests_bound_together_peak_at_the_sum_of_their_answers():
    e = _load(0.1, 10.0, 0.02)
    for _ in range(10):
        e.bind_work(200.0, 10.0, 1.0)
    assert e.kv_peak() == pytest.approx(0.1 + 2000 / CACHE)
    # Two more expected (a grant not bound yet) count as fresh ones.
    assert e.kv_peak(2.0, 400.0) == pytest.approx(0.1 + 2400 / CACHE)
    for _ in range(10):
        e.bind_work(200.0, 10.0, -1.0)
    assert e.kv_peak() == pytest.approx(0.1)


def test_an_unknown_pace_counts_every_answer_whole():
    e = _load(0.0, 10.0, 0.0)
    for i in range(4):
        e.bind_work(100.0, 10.0 - i, 1.0)
    assert e.kv_peak() == pytest.approx(400 / CACHE)


def test_what_each_request_holds_besides_its_answer_is_learned_from_scrapes():
    ep = Endpoint("e1", "http://127.0.0.1:9001", "m")
    ep.num_gpu_blocks, ep.block_size, ep.pace = 256, 16, 0.02
    e = EndpointLoad(limit=256)
    for _ in range(8):
        e.bind_work(200.0, 0.0, 1.0)
    ep.running, ep.waiting, ep.scraped_at = 8.0, 0.0, 0.0
    ep.kv_usage = 8 * 40 / CACHE
    observe_endpoint(e, ep)
    assert e.kv_fixed == pytest.approx(40.0, abs=8.0)  # from two blocks toward the reading
    for k in range(1, 40):
        # At 20 ms a token each has decoded 50 a second; each holds 40 more.
        ep.scraped_at = k * 0.05
        ep.kv_usage = 8 * (40 + 2.5 * k) / CACHE
        observe_endpoint(e, ep)
    assert e.kv_fixed == pytest.approx(40.0, abs=0.5)


def _kv_engine(name: str, port: int, now: float) -> Endpoint:
    ep = Endpoint(name, f"http://127.0.0.1:{port}", "m")
    ep.healthy = True
    ep.num_gpu_blocks, ep.block_size = 256, 16
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at, ep.pace = 0.0, 0.0, 0.0, now, 0.02
    return ep


async def test_a_flood_of_batch_work_is_bound_one_at_a_time_each_engine_in_its_turn():
    """Two KV-bound engines at 20 ms a token, low requests of 200 tokens: each engine takes
    one every m pace (m/2 + kv_fixed) / (0.76 C), the pool twice as often. A high request
    is not held to that pace."""
    t = [1000.0]
    e1, e2 = _kv_engine("e1", 9001, t[0]), _kv_engine("e2", 9002, t[0])
    adm = Admission(AdmissionSettings(aimd_max=64, aimd_initial=64), {"m": Pool("m", [e1, e2])}, clock=lambda: t[0])
    adm.on_metrics(e1)
    adm.on_metrics(e2)
    one = 200 * 0.02 * (100 + 32) / (0.8 * 0.95 * CACHE)  # an engine's interval (kv_fixed: 2 blocks)
    first = await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=200)), 1.0)
    first.bind(e1)
    second = asyncio.ensure_future(adm.admit(Ticket(band="low", max_tokens=200)))
    await asyncio.sleep(0.1)  # several dispatch ticks: the clock has not moved
    assert not second.done()
    high = await asyncio.wait_for(adm.admit(Ticket(band="high", max_tokens=200)), 1.0)
    assert high.has_room(e1)
    high.release("cancelled")
    t[0] += one / 2 + 1e-6  # the pool's turn, not yet e1's
    lease = await asyncio.wait_for(second, 1.0)
    assert not lease.has_room(e1)
    assert lease.has_room(e2)
    lease.bind(e2)
    third = asyncio.ensure_future(adm.admit(Ticket(band="low", max_tokens=200)))
    await asyncio.sleep(0.1)
    assert not third.done()
    t[0] += one / 2
    lease3 = await asyncio.wait_for(third, 1.0)
    assert lease3.has_room(e1)  # e1's turn again
    assert not lease3.has_room(e2)
    for x in (first, lease, lease3):
        x.release("completed")


async def test_batch_work_that_finds_no_engine_in_its_turn_takes_one_early_within_its_share():
    """The pool grants at its engines' rates together, but their turns can drift apart from
    the pool's: a grant may find no engine whose turn has come. It then takes one early
    (skip_turn, asked by the gateway's pick), still under its band's share there; before,
    the pick fell back to any engine below its limit, past low's share."""
    t = [1000.0]
    e1, e2 = _kv_engine("e1", 9001, t[0]), _kv_engine("e2", 9002, t[0])
    adm = Admission(AdmissionSettings(aimd_max=64, aimd_initial=64), {"m": Pool("m", [e1, e2])}, clock=lambda: t[0])
    adm.on_metrics(e1)
    adm.on_metrics(e2)
    one = 200 * 0.02 * (100 + 32) / (0.8 * 0.95 * CACHE)
    held = []
    # Bound out of their turns (as by an earlier early pick): e1 twice, then e2, so that
    # both engines' next turns are at 2 x one while the pool's is at 1.5 x one.
    for at, ep in ((0.0, e1), (0.5, e1), (1.0, e2)):
        t[0] = 1000.0 + at * one + 1e-6
        lease = await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=200)), 1.0)
        lease.bind(ep)
        held.append(lease)
    t[0] = 1000.0 + 1.5 * one + 1e-6
    lease = await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=200)), 1.0)
    assert not lease.has_room(e1) and not lease.has_room(e2)  # neither engine's turn
    e2.inflight += 50  # low's share of e2 taken: 52 of 64, past 0.8
    try:
        assert lease.skip_turn()
        assert lease.has_room(e1)  # early, within low's share
        assert not lease.has_room(e2)  # the turn was all it skipped, not the share
        assert not lease.skip_turn()  # once
    finally:
        e2.inflight -= 50
    high = await asyncio.wait_for(adm.admit(Ticket(band="high", max_tokens=200)), 1.0)
    assert not high.skip_turn()  # work with a deadline never waits for a turn
    for x in held + [lease, high]:
        x.release("cancelled")


async def test_batch_work_aged_into_a_higher_band_keeps_its_pace():
    """A low request that has waited into normal (aging) is still batch work: it is bound
    at the cache's pace, not all at once with the others of its age under normal's rules."""
    t = [1000.0]
    ep = _kv_engine("e1", 9001, t[0])
    s = AdmissionSettings(aimd_max=64, aimd_initial=64, aging_step_ms=1000.0)
    adm = Admission(s, {"m": Pool("m", [ep])}, clock=lambda: t[0])
    adm.on_metrics(ep)
    one = 1000 * 0.02 * (500 + 32) / (0.8 * 0.95 * CACHE)  # 3.4 s
    first = await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=1000)), 1.0)
    first.bind(ep)
    second = asyncio.ensure_future(adm.admit(Ticket(band="low", max_tokens=1000)))
    await asyncio.sleep(0.05)
    t[0] += 1.5  # aged into normal, before its turn
    await asyncio.sleep(0.1)
    assert not second.done()
    t[0] += one - 1.5
    lease = await asyncio.wait_for(second, 1.0)
    for x in (first, lease):
        x.release("completed")


def test_past_the_list_s_length_the_peak_is_every_answer_whole():
    e = _load(0.0, 10.0, 0.02)
    for i in range(600):  # more than kv_peak lists: the sum, which never under-counts
        e.bind_work(1000.0, 10.0 - 0.01 * i, 1.0)
    assert e.kv_peak() == pytest.approx(e.kv_ahead(10.0))
    assert e.kv_peak() > 0.0


async def _low_granted(adm: Admission, t: list, ep: Endpoint, step: float) -> object:
    """A low request after the engine's next turn, on a fresh scrape: its lease, or None
    when it still waits after several dispatch ticks (then withdrawn)."""
    t[0] += step
    ep.scraped_at = t[0]
    adm.on_metrics(ep)
    fut = asyncio.ensure_future(adm.admit(Ticket(band="low", max_tokens=200)))
    await asyncio.sleep(0.1)
    if fut.done():
        return fut.result()
    fut.cancel()
    await asyncio.gather(fut, return_exceptions=True)
    return None


@pytest.mark.parametrize("borrow_after_ms", [60000.0, 0.0])
async def test_batch_work_passes_its_share_of_the_cache_until_a_band_it_holds_back_asks(borrow_after_ms):
    """The pace aims batch work at its share of the cache (0.76 for low); held there at its
    peak too, work bound just before a wave of answers ended would pass it, so the next
    wave began where the last ended. While no band the cache holds back (normal, which its
    KV term stops at 0.8 of it) has asked, the cache as it will be may pass the share, up
    to the engine's margin (95 %): a high request does not end that, a normal one does.
    ``admission.borrow_after_ms: 0`` (never borrow) keeps the share."""
    t = [1000.0]
    ep = _kv_engine("e1", 9001, t[0])
    s = AdmissionSettings(aimd_max=64, aimd_initial=64, borrow_after_ms=borrow_after_ms)
    adm = Admission(s, {"m": Pool("m", [ep])}, clock=lambda: t[0])
    adm.on_metrics(ep)
    one = 200 * 0.02 * (100 + 32) / (0.8 * 0.95 * CACHE)
    first = await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=200)), 1.0)
    first.bind(ep)
    held = [first]
    ep.kv_usage = 0.72  # other work: with one more low request the peak passes 0.76
    lease = await _low_granted(adm, t, ep, one + 1e-6)
    peak = adm.stats()["endpoints"]["e1"]["kv_peak"]
    try:
        past = adm.stats()["pools"]["m"]["batch_peak_past_share"]
        if not borrow_after_ms:
            assert lease is None  # the share holds
            assert past is False  # and /stats says so
            return
        assert past is True
        assert lease is not None
        lease.bind(ep)
        held.append(lease)
        assert 0.76 < adm.stats()["endpoints"]["e1"]["kv_peak"] < 0.95, peak
        high = await asyncio.wait_for(adm.admit(Ticket(band="high", max_tokens=8)), 1.0)
        high.release("completed")
        lease = await _low_granted(adm, t, ep, one + 1e-6)
        assert lease is not None  # high asked: it needs only the margin
        lease.bind(ep)
        held.append(lease)
        normal = await asyncio.wait_for(adm.admit(Ticket(band="normal", max_tokens=8)), 1.0)
        normal.release("completed")
        assert await _low_granted(adm, t, ep, one + 1e-6) is None  # normal asked: the share holds
        assert adm.stats()["pools"]["m"]["batch_peak_past_share"] is False
    finally:
        for x in held:
            x.release("completed")
