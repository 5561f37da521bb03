"""SLAs per band, the queue model of admitted work, and Retry-After promises,
with fake endpoints and a hand-driven clock (no HTTP, no engines)."""

import asyncio

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.errors import AdmissionConfigError, Rejected
from velocity_fast.admission.settings import AdmissionSettings, BandSettings
from velocity_fast.fleet.endpoint import Endpoint, Pool

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def make(n=1, limit=4, clock=None, policy="dynamic", **kw):
    eps = [Endpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}", "m") for i in range(n)]
    for e in eps:
        e.healthy = True
    kw.setdefault("aimd_initial", 0)
    adm = Admission(
        AdmissionSettings(aimd_max=limit, **kw), {"m": Pool("m", eps)}, policy=policy, clock=clock or Clock()
    )
    return adm, eps


async def learn(adm, ep, clock, service=0.5, tokens=20, n=3, band="high"):
    """``n`` whole answers of ``tokens`` taking ``service`` each, one at a time."""
    for _ in range(n):
        lease = await adm.admit(Ticket(band=band, max_tokens=tokens))
        lease.bind(ep)
        clock.t += service
        lease.first_byte()  # a whole answer: its first byte is its last
        lease.release("completed", tokens=tokens)


def fill(adm, eps, k, tokens=20, band="high"):
    """``k`` leases granted at once and bound, spread over ``eps``."""
    out = []
    for i in range(k):
        lease = adm.admit_nowait(Ticket(band=band, max_tokens=tokens), None)
        assert lease.__class__.__name__ == "Lease", lease
        lease.bind(eps[i % len(eps)])
        out.append(lease)
    return out


def test_band_sla_settings_default_low_has_none_and_bad_values_are_refused():
    bands = {b.name: b for b in AdmissionSettings().bands}
    assert bands["low"].sla_ms == 0 and bands["normal"].sla_ms is None and bands["high"].sla_ms is None
    with pytest.raises(AdmissionConfigError, match=r"bands\[0\]\.sla_ms"):
        AdmissionSettings(bands=[BandSettings(name="a", ceiling=1.0, sla_ms=-5)]).validate()


async def test_low_work_has_no_deadline_it_queues_instead_of_a_429_and_is_not_judged():
    clock = Clock()
    adm, (ep,) = make(limit=2, clock=clock, sla_ms=1000)
    await learn(adm, ep, clock)
    held = fill(adm, [ep], 2)
    # normal: the server's SLA of 1 s; two ahead of 0.5 s on two slots, then its own 0.5 s
    # fits; the next one does not.
    (first,) = [asyncio.ensure_future(adm.admit(Ticket(band="normal", max_tokens=20)))]
    await asyncio.sleep(0)
    with pytest.raises(Rejected):
        await adm.admit(Ticket(band="normal", max_tokens=20))
    # low: no deadline, so however deep the queue it waits its turn.
    lows = [asyncio.ensure_future(adm.admit(Ticket(band="low", max_tokens=20))) for _ in range(10)]
    await asyncio.sleep(0)
    assert not any(t.done() for t in lows)
    assert adm.stats()["rejections"] == {"sla": 1}
    # Its own SLA (or its tenant's) still applies to a low request.
    with pytest.raises(Rejected):
        await adm.admit(Ticket(band="low", max_tokens=20, sla_ms=800))
    for le in held:
        clock.t += 0.5
        le.release("completed", tokens=20)
    (await first).release("completed", tokens=20)
    done = 0
    for _ in range(40):
        for t in lows:
            if t.done() and t.result().endpoint is None:
                t.result().bind(ep)
                clock.t += 5.0  # far past any SLA: low work is not judged against one
                t.result().release("completed", tokens=20)
                done += 1
        await asyncio.sleep(0)
        if done == len(lows):
            break
    assert done == len(lows)
    sla = adm.stats()["sla"]
    assert sla["missed"] == 0 and sla["met"] == 3 + 2 + 1  # the learning, the held, the first


async def test_a_bands_own_sla_overrides_the_servers_and_a_requests_overrides_the_bands():
    clock = Clock()
    bands = [
        BandSettings(name="high", ceiling=1.5),
        BandSettings(name="normal", ceiling=1.0, sla_ms=5000),
        BandSettings(name="low", ceiling=0.8, sla_ms=0),
    ]
    adm, (ep,) = make(limit=1, clock=clock, sla_ms=600, bands=bands)
    await learn(adm, ep, clock)
    held = fill(adm, [ep], 1)
    # normal: 0.5 s ahead + 0.5 s of its own is past the server's 0.6 s, inside its band's 5 s.
    (ok,) = [asyncio.ensure_future(adm.admit(Ticket(band="normal", max_tokens=20)))]
    await asyncio.sleep(0)
    assert not ok.done()
    with pytest.raises(Rejected):  # its own 0.6 s wins over the band's
        await adm.admit(Ticket(band="normal", max_tokens=20, sla_ms=600))
    with pytest.raises(Rejected):  # high has no SLA of its own: the server's (with its tolerance)
        await adm.admit(Ticket(band="high", max_tokens=40))
    held[0].release("completed", tokens=20)
    (await ok).release("cancelled")


async def test_the_queue_model_counts_the_admitted_work_by_its_size():
    """Short requests taught 20 ms a token; 16 long ones (60 tokens, 1.2 s) hold the
    slots: one more long one would wait a whole service (1.2 s) and miss a 2 s SLA,
    although the short ones' mean service (0.32 s) would have let it in."""
    clock = Clock()
    adm, eps = make(n=2, limit=8, clock=clock)
    await learn(adm, eps[0], clock, service=0.32, tokens=16, n=6)
    fill(adm, eps, 16, tokens=60)
    wait, service = adm.prediction("m", "high", 60)
    assert service == pytest.approx(1.2) and wait == pytest.approx(1.2)
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(band="normal", max_tokens=60, sla_ms=2000))
    assert e.value.reason == "sla"
    # A short one still fits behind them: 1.2 s then 0.32 s.
    (short,) = [asyncio.ensure_future(adm.admit(Ticket(band="normal", max_tokens=16, sla_ms=2000)))]
    await asyncio.sleep(0)
    assert not short.done()
    # Half-way through, the work left is half: the model follows the leases' expected ends.
    clock.t += 0.6
    wait, _ = adm.prediction("m", "normal", 60)
    assert wait == pytest.approx((16 * 0.6 + 0.32) / 16)
    short.cancel()
    await asyncio.gather(short, return_exceptions=True)
    adm.close()


async def test_a_queued_request_that_can_no_longer_finish_in_time_is_declined_not_granted():
    """Nothing was known when it was queued; the estimate learned since says it would
    miss: when its slot frees it is declined (429 sla), never admitted to miss."""
    clock = Clock()
    adm, (ep,) = make(limit=1, clock=clock)
    held = fill(adm, [ep], 1, tokens=60)
    (late,) = [asyncio.ensure_future(adm.admit(Ticket(band="normal", max_tokens=60, sla_ms=2000)))]
    await asyncio.sleep(0)
    assert not late.done()
    clock.t += 1.2
    held[0].first_byte()
    held[0].release("completed", tokens=60)  # 1.2 s: 0.8 s are left, 1.2 s are needed
    with pytest.raises(Rejected) as e:
        await late
    assert e.value.reason == "sla" and e.value.retry_after >= 0
    assert adm.stats()["counters"]["admitted"] == 1


async def test_retry_after_paces_a_burst_at_the_rate_the_engines_drain():
    """16 slots, 0.85 s a request, a 2 s SLA: successive declines are told successive
    times, one service per slot apart, and each time is when a request arriving then would
    be admitted within its SLA (with a tenth of it to spare)."""
    clock = Clock()
    adm, eps = make(n=2, limit=8, clock=clock, sla_ms=2000)
    await learn(adm, eps[0], clock, service=0.85, tokens=40, n=4)
    fill(adm, eps, 16, tokens=40, band="normal")
    # Queued while the work ahead, drained by 16 slots, leaves time for its own 0.85 s:
    # (16 + k) x 0.85 / 16 + 0.85 <= 2 for the k-th, so six.
    queued = [asyncio.ensure_future(adm.admit(Ticket(max_tokens=40))) for _ in range(6)]
    await asyncio.sleep(0)
    assert not any(t.done() for t in queued)
    told = []
    for _ in range(40):
        with pytest.raises(Rejected) as e:
            await adm.admit(Ticket(max_tokens=40))
        told.append(e.value.retry_after)
    steps = [b - a for a, b in zip(told, told[1:])]
    assert steps == pytest.approx([0.85 / 16] * len(steps))
    # The first: 22 x 0.85 s of work on 16 slots must drain to (2 x 0.9 - 0.85) x 16.
    assert told[0] == pytest.approx((22 * 0.85 - (1.8 - 0.85) * 16) / 16)
    assert adm.promise_counts["made"] == 40
    # Its time come, with the engines at the pace learned, each promise is kept.
    for t in queued:
        t.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    clock.t += told[-1] + 0.01
    adm.housekeep()
    assert adm.promise_counts == {"made": 40, "kept": 40, "broken": 0}


async def test_a_promise_that_no_longer_holds_is_counted_broken():
    clock = Clock()
    adm, (ep,) = make(limit=1, clock=clock, sla_ms=1000)
    await learn(adm, ep, clock)
    held = fill(adm, [ep], 1, band="normal")
    (q,) = [asyncio.ensure_future(adm.admit(Ticket(max_tokens=20)))]
    await asyncio.sleep(0)
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(max_tokens=20))
    # Higher bands take the room before it comes back: a queue of high work.
    highs = [asyncio.ensure_future(adm.admit(Ticket(band="high", max_tokens=20))) for _ in range(4)]
    await asyncio.sleep(0)
    clock.t += e.value.retry_after + 0.001
    adm.housekeep()
    assert adm.promise_counts["broken"] == 1 and adm.promise_counts["kept"] == 0
    for t in [q, *highs]:
        t.cancel()
    await asyncio.gather(q, *highs, return_exceptions=True)
    held[0].release("cancelled")
    adm.close()


async def test_deadline_free_latency_does_not_shrink_the_limit_and_low_work_grows_it():
    """Low work alone, each answer's first token far past the TTFT SLO: no cut (only
    deadline-free work saw it), and the limit grows although low work stops at 0.8 of it
    (it is what holds that work back)."""
    clock = Clock()
    adm, (ep,) = make(limit=32, clock=clock, aimd_initial=8, ttft_slo_ms=100)
    tasks = [asyncio.ensure_future(adm.admit(Ticket(band="low", max_tokens=20))) for _ in range(60)]
    await asyncio.sleep(0)
    running = []
    for _ in range(10):
        for t in tasks:
            if t.done() and t.result().endpoint is None and not t.result().done:
                t.result().bind(ep)
                running.append(t.result())
        le = running.pop(0)
        clock.t += 3.0
        le.first_byte()
        le.release("completed", tokens=20)
        await asyncio.sleep(0)
    assert ep.limit == 18  # 8, then +1 a completion
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for le in running:
        le.release("cancelled")
    adm.close()


async def test_low_work_fills_a_learned_batch_but_one_slot_and_a_guessed_one_to_its_soft_ceiling():
    """Once an engine's gauges showed its batch (16), batch work runs all of it but one slot
    (ceiling 0.95, the grant counted); before, the limit only stands in for the batch and
    the soft ceiling (0.7) holds."""
    clock = Clock()
    adm, (ep,) = make(limit=32, clock=clock)
    got = [adm.admit_nowait(Ticket(band="low"), None) for _ in range(40)]
    leases = [le for le in got if le.__class__.__name__ == "Lease"]
    for le in leases:
        le.bind(ep)
    assert len(leases) == 22  # 0.7 of 32, the grant counted
    for _ in range(2):  # two scrapes with a queue beside 16 running: the batch is 16
        clock.t += 0.1
        ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 16, 9, 0.3, clock.t
        adm.on_metrics(ep)
    assert adm.stats()["endpoints"]["e0"]["batch_capacity"] == 16
    for le in leases[15:]:
        le.release("cancelled")
    await asyncio.sleep(0)
    clock.t += 0.1
    ep.running, ep.waiting, ep.scraped_at = 15, 0, clock.t  # the engine's queue drained
    adm.on_metrics(ep)
    assert ep.inflight == 15  # all of the 16 but one: none of the queued took the last
    high = adm.admit_nowait(Ticket(band="high"), None)
    assert high.__class__.__name__ == "Lease"  # and a high one goes at once
    adm.close()
    for it in got:
        if it.__class__.__name__ == "Item" and it.waiter.done() and not it.waiter.cancelled():
            it.waiter.exception()  # the shutdown's 503, retrieved


async def test_retry_after_looks_no_further_than_a_minute():
    clock = Clock()
    adm, (ep,) = make(limit=1, clock=clock, sla_ms=1000)
    await learn(adm, ep, clock, service=2.0, tokens=20)
    held = fill(adm, [ep], 1, band="normal")
    told = []
    for _ in range(100):
        with pytest.raises(Rejected) as e:
            await adm.admit(Ticket(max_tokens=20))
        told.append(e.value.retry_after)
    assert told == sorted(told) and told[-1] == 60.0 and told[0] < 60.0
    held[0].release("cancelled")
    adm.close()
