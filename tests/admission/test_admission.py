"""Admission controller with fake endpoints driven by hand (no HTTP, no engines)."""

import asyncio
import math
import time

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.errors import Rejected
from velocity_fast.admission.estimators import Ewma, ServiceEstimate
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.admission.telemetry import Window, percentiles
from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.metrics.registry import Registry


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def make(policy="dynamic", n=1, limit=4, clock=None, registry=None, **kw):
    eps = [Endpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}", "m") for i in range(n)]
    for e in eps:
        e.healthy = True
    kw.setdefault("aimd_min", 1)
    kw.setdefault("aimd_initial", 0)  # these tests start at the limit they name
    settings = AdmissionSettings(aimd_max=limit, **kw)
    adm = Admission(settings, {"m": Pool("m", eps)}, policy=policy, registry=registry, clock=clock or time.monotonic)
    return adm, eps


async def queued(adm, *tickets):
    """Start admits as tasks and let each reach its queue."""
    tasks = [asyncio.create_task(adm.admit(t)) for t in tickets]
    await asyncio.sleep(0)
    return tasks


def scrape_engine(adm, ep, clock, running, waiting):
    """A tenth of a second on, the engine's gauges scraped as given."""
    clock.t += 0.1
    ep.running, ep.waiting, ep.scraped_at = running, waiting, clock.t
    adm.on_metrics(ep)


def reconciles(adm):
    c = adm.stats()["counters"]
    return c["admitted"] == c["completed"] + c["failed"] + c["cancelled"] + c["in_flight"]


async def test_idle_pool_grants_at_once_and_lease_tracks_inflight():
    adm, (ep,) = make()
    lease = await adm.admit(Ticket(band="normal", tenant="a", max_tokens=10))
    assert lease.band == "normal" and lease.queue_ms == 0.0
    assert adm.has_room(ep)
    lease.bind(ep)
    assert ep.inflight == 1 and lease.endpoint is ep
    lease.first_byte()
    lease.release("completed", tokens=10)
    lease.release("failed")  # a second release is ignored
    assert ep.inflight == 0
    s = adm.stats()
    assert s["counters"] == {"admitted": 1, "completed": 1, "failed": 0, "cancelled": 0, "in_flight": 0}
    assert reconciles(adm)


async def test_full_pool_queues_and_dispatches_high_before_low():
    adm, (ep,) = make(limit=2)
    leases = [await adm.admit(Ticket(band="high")) for _ in range(2)]
    for le in leases:
        le.bind(ep)
    low, high = await queued(adm, Ticket(band="low", tenant="x"), Ticket(band="high", tenant="y"))
    assert adm.stats()["bands"]["low"]["depth"] == 1
    assert adm.stats()["bands"]["high"]["depth"] == 1
    leases[0].release("completed")
    got = await asyncio.wait_for(high, 1)
    assert got.band == "high" and not low.done()
    got.bind(ep)
    got.release("completed")
    leases[1].release("completed")
    # Low waits for 80 % of the limit: with 2 slots, it goes once both are free.
    got = await asyncio.wait_for(low, 1)
    assert got.band == "low"
    got.release("completed")
    assert reconciles(adm)


async def test_low_band_keeps_headroom_for_higher_bands():
    adm, (ep,) = make(limit=10)
    lows = []
    for _ in range(20):
        lows.append(asyncio.create_task(adm.admit(Ticket(band="low"))))
    await asyncio.sleep(0.01)
    granted = [t for t in lows if t.done()]
    # The engine's batch is not learned: the limit stands in for it, and low's soft
    # ceiling (0.7) holds: 7 of 10, the grant counted.
    assert len(granted) == 7
    for t in granted:
        t.result().bind(ep)
    high = await asyncio.wait_for(adm.admit(Ticket(band="high")), 1)
    assert high.queue_ms == 0.0
    high.release("cancelled")
    for t in granted:
        t.result().release("completed")
    for t in lows:
        if not t.done():
            t.cancel()
    await asyncio.gather(*lows, return_exceptions=True)
    assert adm.stats()["queued"] == 0 and reconciles(adm)


async def test_two_hundred_simultaneous_requests_do_not_pass_en_masse():
    adm, eps = make(n=2, limit=8)
    tasks = [asyncio.create_task(adm.admit(Ticket(band="normal"))) for _ in range(200)]
    await asyncio.sleep(0.01)
    granted = [t for t in tasks if t.done()]
    # Granted but not yet bound leases count: no more than one endpoint's 8 slots.
    assert 1 <= len(granted) <= 8
    bound = set()
    for _ in range(20):  # each lease binds where there is room; binding frees the next grants
        for t in tasks:
            if t.done() and t not in bound:
                lease = t.result()
                lease.bind(min(eps, key=lambda e: e.inflight))
                bound.add(t)
        await asyncio.sleep(0.001)
    # The pool's 16 slots and not one more.
    assert len(bound) == 16 and sum(e.inflight for e in eps) == 16
    assert all(e.inflight <= e.limit for e in eps)
    assert adm.stats()["bands"]["normal"]["depth"] == 184
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.stats()["queued"] == 0 and reconciles(adm)


async def test_queue_full_is_503_capacity():
    from velocity_fast.admission.settings import BandSettings

    bands = [
        BandSettings(name="high", ceiling=1.5, queue_capacity=1),
        BandSettings(name="normal", ceiling=1.0, queue_capacity=2),
    ]
    adm, (ep,) = make(limit=1, bands=bands)
    first = await adm.admit(Ticket(band="normal"))
    waiting = await queued(adm, Ticket(band="normal"), Ticket(band="normal"))
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(band="normal"))
    assert (e.value.status, e.value.reason) == (503, "capacity")
    assert ("x-velocity-reject-reason", "capacity") in e.value.headers()
    assert adm.stats()["rejections"] == {"capacity": 1}
    first.release("completed")
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_ttl_is_504():
    from velocity_fast.admission.settings import BandSettings

    bands = [BandSettings(name="normal", ceiling=1.0, ttl_ms=30)]
    adm, (ep,) = make(limit=1, bands=bands, tick_ms=5)
    held = await adm.admit(Ticket())
    t0 = time.monotonic()
    with pytest.raises(Rejected) as e:
        await asyncio.wait_for(adm.admit(Ticket()), 2)
    assert (e.value.status, e.value.reason) == (504, "ttl")
    assert time.monotonic() - t0 < 1.0
    assert adm.stats()["queued"] == 0
    held.release("completed")
    adm.close()


async def test_cancelled_queued_request_leaves_at_once():
    adm, (ep,) = make(limit=1)
    held = await adm.admit(Ticket())
    (task,) = await queued(adm, Ticket(band="low"))
    assert adm.stats()["bands"]["low"]["depth"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = adm.stats()
    assert s["bands"]["low"]["depth"] == 0 and s["queue_cancelled"] == 1
    held.release("completed")
    assert reconciles(adm) and adm.stats()["counters"]["admitted"] == 1


async def finish(adm, ep, clock, service=0.5, ttft=0.1, tokens=20, n=3):
    for _ in range(n):
        lease = await adm.admit(Ticket())
        lease.bind(ep)
        clock.t += ttft
        lease.first_byte()
        clock.t += service - ttft
        lease.release("completed", tokens=tokens)


async def test_sla_far_below_service_is_429_at_once_when_it_would_queue_never_when_idle():
    clock = Clock()
    adm, (ep,) = make(limit=2, clock=clock)
    await finish(adm, ep, clock)  # 0.5 s per request, learned
    # Idle: admitted even though it cannot make it.
    idle = await adm.admit(Ticket(sla_ms=20, max_tokens=20))
    idle.bind(ep)
    # Busy, but a slot is free: it goes at once, and a request that goes at once is
    # never declined on a prediction (no wait of the gateway's making is in its way).
    second = await adm.admit(Ticket(sla_ms=20, max_tokens=20))
    second.bind(ep)
    # Full: it would queue, so the prediction decides: declined at once, with a
    # Retry-After from the queue model. An SLA shorter than the service itself is met by
    # no wait: come back once the work ahead (2 x 0.5 s on 2 slots) has drained.
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(sla_ms=20, max_tokens=20))
    assert (e.value.status, e.value.reason) == (429, "sla")
    assert e.value.retry_after == pytest.approx(0.5)
    headers = e.value.headers()
    assert ("retry-after", "1") in headers and ("retry-after-ms", "500") in headers
    # A generous SLA queues instead.
    (ok,) = await queued(adm, Ticket(sla_ms=5000, max_tokens=20))
    assert not ok.done()
    idle.release("completed")
    (await ok).release("cancelled")
    second.release("completed")
    assert adm.stats()["rejections"] == {"sla": 1}


async def test_the_servers_sla_is_enforced_for_requests_that_name_none():
    """--sla-ms is a real SLA: a request without its own is predicted against it and
    declined at once when it would queue past it; Retry-After grows with the queue."""
    clock = Clock()
    adm, (ep,) = make(limit=1, clock=clock, sla_ms=1200)
    await finish(adm, ep, clock, service=0.5, ttft=0.1, tokens=20)
    held = await adm.admit(Ticket(max_tokens=20))
    held.bind(ep)
    # One ahead of it at 0.5 s, then its own 0.5 s: 1.0 s, inside 1.2 s: it queues.
    (first,) = await queued(adm, Ticket(max_tokens=20))
    assert not first.done()
    # The next would wait 1.0 s, then 0.5 s of its own: 1.5 s > 1.2 s * 1.1: declined.
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(max_tokens=20))
    assert (e.value.status, e.value.reason) == (429, "sla")
    # Back when the 1.0 s of work ahead has drained to what its SLA leaves for a wait,
    # with a tenth of the SLA to spare: 1.2 * 0.9 - 0.5 = 0.58 s, so in 0.42 s.
    assert e.value.retry_after == pytest.approx(0.42)
    assert adm.prediction("m", None, 20) == pytest.approx((1.0, 0.5))
    # Its own SLA still wins over the server's.
    (patient,) = await queued(adm, Ticket(max_tokens=20, sla_ms=10000))
    assert not patient.done()
    held.release("completed")
    for t in (first, patient):
        (await t).release("cancelled")
    assert adm.stats()["rejections"] == {"sla": 1}


async def test_a_queued_request_that_can_no_longer_meet_the_servers_sla_is_declined_early():
    clock = Clock()
    adm, (ep,) = make(limit=1, clock=clock, sla_ms=2000)
    await finish(adm, ep, clock, service=0.5, ttft=0.1, tokens=20)
    held = await adm.admit(Ticket(max_tokens=20))
    held.bind(ep)
    (t,) = await queued(adm, Ticket(max_tokens=20))  # 0.5 + 0.5 s: fits in 2 s, queues
    assert not t.done()
    clock.t += 1.6  # the engine is stuck: 0.4 s left, 0.5 s of service needed
    adm.housekeep()
    with pytest.raises(Rejected) as e:
        await t
    assert (e.value.status, e.value.reason) == (429, "sla")  # long before the 30 s TTL
    held.release("completed")
    adm.close()


async def test_slow_start_follows_the_engines_scrapes_until_it_shows_a_queue():
    """From the initial limit, each scrape that shows the engine running all it was sent
    while work waits grows the limit by half; once the engine queues, the learned batch
    bounds what is sent and the growth stops."""
    clock = Clock()
    adm, (ep,) = make(limit=32, clock=clock, aimd_initial=8)
    tasks = [asyncio.create_task(adm.admit(Ticket())) for _ in range(40)]
    await asyncio.sleep(0)
    leases = [t.result() for t in tasks if t.done()]
    for le in leases:
        le.bind(ep)
    assert ep.limit == 8 and ep.inflight == 8

    def scrape(running, waiting):
        scrape_engine(adm, ep, clock, running, waiting)
        for t in tasks:
            if t.done() and t.result() not in leases:
                leases.append(t.result())
                t.result().bind(ep)

    scrape(8, 0)
    assert ep.limit == 12
    await asyncio.sleep(0)
    scrape(10, 2)  # the engine runs 10: two of ours wait in it
    assert ep.limit == 12  # no growth while the engine queues
    scrape(10, 2)
    assert adm.stats()["endpoints"]["e0"]["batch_capacity"] == 10
    for le in leases:
        le.release("cancelled")
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_new_engine_starts_at_the_initial_limit_and_earns_more():
    """Slow start: a cold flood does not overfill an engine whose batch is unknown."""
    clock = Clock()
    adm, (ep,) = make(limit=32, clock=clock, aimd_initial=8)
    got = [await adm.admit(Ticket()) for _ in range(8)]
    for le in got:
        le.bind(ep)
    assert ep.limit == 8
    (waiting,) = await queued(adm, Ticket())
    assert not waiting.done()
    clock.t += 0.5
    got[0].release("completed", tokens=16)  # queued work, at the limit, healthy: +1
    assert ep.limit == 9
    (await waiting).release("cancelled")
    for le in got[1:]:
        le.release("cancelled")


async def test_static_policy_never_rejects_on_sla_and_has_one_band():
    clock = Clock()
    adm, (ep,) = make(policy="static", limit=4, clock=clock)
    await finish(adm, ep, clock)
    busy = await adm.admit(Ticket())
    busy.bind(ep)
    lease = await adm.admit(Ticket(band="high", sla_ms=20))
    assert lease.band == "all" and ep.limit == 4
    lease.release("completed")
    busy.release("completed")
    assert list(adm.stats()["bands"]) == ["all"]


async def test_oom_drops_limit_sheds_non_high_then_recovers():
    clock = Clock()
    adm, (ep,) = make(limit=8, clock=clock, oom_cooldown_ms=5000)
    leases = [await adm.admit(Ticket(band="high")) for _ in range(8)]
    for le in leases:
        le.bind(ep)
    (queued_normal,) = await queued(adm, Ticket(band="normal"))
    leases[0].release("failed", error_text="CUDA out of memory. Tried to allocate 2.00 GiB")
    assert ep.limit == 1
    with pytest.raises(Rejected) as e:
        await queued_normal
    assert (e.value.status, e.value.reason) == (503, "overload")
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(band="low"))
    assert e.value.reason == "overload" and e.value.retry_after == 5
    for le in leases[1:]:
        le.release("completed")
    # Still serving high work at the minimum limit.
    high = await adm.admit(Ticket(band="high"))
    high.bind(ep)
    assert ep.inflight == 1
    high.release("completed")
    assert adm.stats()["endpoints"]["e0"]["frozen"]
    clock.t += 5.1
    normal = await adm.admit(Ticket(band="normal"))
    normal.release("completed")
    # Increases resume after the cool-down.
    a = await adm.admit(Ticket(band="high"))
    a.bind(ep)
    (b,) = await queued(adm, Ticket(band="high"))
    a.release("completed")
    assert ep.limit == 2
    (await b).release("completed")
    assert reconciles(adm)


async def test_stale_metrics_do_not_halt_dispatch():
    clock = Clock()
    adm, (ep,) = make(limit=4, clock=clock)
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 4, 100, 0.99, clock.t
    adm.on_metrics(ep)
    (t,) = await queued(adm, Ticket(band="normal"))
    assert not t.done()  # fresh metrics say the engine is swamped
    clock.t += 5  # the scrape hangs: no new metrics for 5 s
    adm.housekeep()
    lease = await asyncio.wait_for(t, 1)
    lease.release("completed")
    adm.close()


async def test_one_hot_engine_does_not_hold_back_the_pool():
    clock = Clock()
    adm, (hot, cool) = make(n=2, limit=8, clock=clock)
    hot.running, hot.waiting, hot.kv_usage, hot.scraped_at = 8, 40, 0.97, clock.t
    cool.running, cool.waiting, cool.kv_usage, cool.scraped_at = 1, 0, 0.1, clock.t
    adm.on_metrics(hot)
    adm.on_metrics(cool)
    lease = await asyncio.wait_for(adm.admit(Ticket(band="low")), 1)
    assert lease.queue_ms == 0.0
    lease.release("completed")
    s = adm.stats()
    assert s["endpoints"]["e0"]["saturation"] > 5 and s["pools"]["m"]["saturation"] < 0.8


async def test_saturated_pool_holds_low_but_not_high():
    clock = Clock()
    adm, (ep,) = make(limit=8, clock=clock)
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 8, 6, 0.5, clock.t  # 1.2
    ep.inflight_peak = 8  # the 8 running were this gateway's (since ended), not a replica's
    adm.on_metrics(ep)
    normal, low = await queued(adm, Ticket(band="normal"), Ticket(band="low"))
    high = await asyncio.wait_for(adm.admit(Ticket(band="high")), 1)
    assert not normal.done() and not low.done()
    ep.running, ep.waiting, ep.scraped_at = 0, 0, clock.t + 0.1  # the engine's work done
    clock.t += 0.1
    adm.on_metrics(ep)
    (await normal).release("completed")
    (await low).release("completed")
    high.release("completed")


async def test_aging_lets_low_work_through_under_the_high_ceiling():
    clock = Clock()
    adm, (ep,) = make(limit=8, clock=clock, aging_step_ms=1000)
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 8, 5, 0.5, clock.t  # 1.0: low held
    ep.inflight_peak = 8  # the 8 running were this gateway's (since ended), not a replica's
    adm.on_metrics(ep)
    (low,) = await queued(adm, Ticket(band="low"))
    assert not low.done()
    clock.t += 0.5
    ep.scraped_at = clock.t
    adm.on_metrics(ep)
    assert not low.done()
    clock.t += 1.6  # two steps: low -> high, whose ceiling 1.5 lets it through
    ep.scraped_at = clock.t
    adm.on_metrics(ep)
    lease = await asyncio.wait_for(low, 1)
    assert lease.band == "low"
    lease.release("completed")


async def test_aimd_grows_with_queued_work_and_shrinks_on_breach():
    clock = Clock()
    adm, (ep,) = make(limit=8, clock=clock, aimd_initial=2, ttft_slo_ms=1000)
    a, b = await adm.admit(Ticket(band="high")), await adm.admit(Ticket(band="high"))
    a.bind(ep)
    b.bind(ep)
    (c,) = await queued(adm, Ticket(band="high"))
    clock.t += 0.05
    a.first_byte()
    a.release("completed", tokens=5)
    assert ep.limit == 3
    c = await c
    c.bind(ep)
    clock.t += 2.0  # b's first byte after 2 s: a latency breach
    b.first_byte()
    b.release("completed", tokens=5)
    assert ep.limit == 2
    c.release("completed")
    assert adm.stats()["limits"] == {"e0": 2}


async def test_smart_drops_queued_requests_that_became_hopeless():
    clock = Clock()
    adm, (ep,) = make(policy="smart", limit=1, clock=clock)
    await finish(adm, ep, clock, service=0.5, ttft=0.1, tokens=20)
    held = await adm.admit(Ticket())
    held.bind(ep)
    # 2 s is enough now (0.5 s of service), so it queues rather than 429.
    (t,) = await queued(adm, Ticket(sla_ms=2000, max_tokens=20))
    clock.t += 1.8
    adm.housekeep()
    with pytest.raises(Rejected) as e:
        await t
    assert (e.value.status, e.value.reason) == (429, "sla")
    held.release("completed")
    adm.close()


async def test_no_healthy_endpoint_is_503():
    adm, (ep,) = make()
    ep.healthy = False
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket())
    assert (e.value.status, e.value.reason) == (503, "no-endpoint")
    adm2, _ = make()
    with pytest.raises(Rejected):
        await adm2.admit(Ticket(model="unknown"))


async def test_token_fairness_between_tenants_end_to_end():
    adm, (ep,) = make(limit=1, fairness="tokens")
    held = await adm.admit(Ticket())
    long_ = await queued(adm, *[Ticket(tenant="long", max_tokens=2000) for _ in range(10)])
    short = await queued(adm, *[Ticket(tenant="short", max_tokens=20) for _ in range(10)])
    order = []
    held.release("completed")
    for _ in range(12):
        done, _ = await asyncio.wait(long_ + short, return_when=asyncio.FIRST_COMPLETED)
        t = next(t for t in done if t not in order)
        order.append(t)
        t.result().release("completed")
        await asyncio.sleep(0)
    assert sum(1 for t in order if t in short) >= 9
    for t in long_ + short:
        t.cancel()
    await asyncio.gather(*long_, *short, return_exceptions=True)
    assert reconciles(adm)


async def test_stats_and_metrics():
    reg = Registry()
    adm, (ep,) = make(registry=reg)
    lease = await adm.admit(Ticket(band="high"))
    lease.bind(ep)
    lease.first_byte()
    lease.release("completed", tokens=3)
    with pytest.raises(Rejected):
        await adm.admit(Ticket(model="nope"))
    s = adm.stats()
    assert set(s) >= {"policy", "counters", "rejections", "bands", "limits", "sla", "latency_ms", "pools"}
    assert s["policy"] == "dynamic" and s["limits"] == {"e0": 4}
    assert s["sla"]["compliance"] == 1.0 and "p99" in s["latency_ms"]["e2e"]
    assert s["bands"]["high"]["wait_ms"]["p50"] == 0.0
    text = reg.render().decode()
    for name in (
        "velocity_admitted_total 1.0",
        'velocity_rejections_total{reason="no-endpoint"} 1.0',
        'velocity_queue_depth{band="low"} 0',
        'velocity_endpoint_limit{endpoint="e0"} 4',
        'velocity_pool_saturation{model="m"}',
        "velocity_queue_wait_seconds_bucket",
    ):
        assert name in text, name


async def test_lease_granted_but_task_cancelled_is_released():
    adm, (ep,) = make(limit=1)
    held = await adm.admit(Ticket())
    (t,) = await queued(adm, Ticket())
    held.release("completed")  # grants t's lease; t has not run yet
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    c = adm.stats()["counters"]
    assert c["in_flight"] == 0 and reconciles(adm)
    assert math.isclose(adm.stats()["pools"]["m"]["pending_leases"], 0)


def test_ticket_defaults_and_rejected_shape():
    t = Ticket(max_tokens=None, prompt_bytes=None)
    assert (t.max_tokens, t.prompt_bytes, t.band, t.tenant) == (16, 0, None, None)
    r = Rejected(504, "ttl", "waited too long")
    assert r.headers() == [("x-velocity-reject-reason", "ttl")] and str(r) == "waited too long"


async def test_sla_prediction_learns_from_first_bytes_before_any_completion():
    clock = Clock()
    adm, (ep,) = make(limit=1, clock=clock)
    streaming = await adm.admit(Ticket())
    streaming.bind(ep)
    clock.t += 0.3
    streaming.first_byte()  # still streaming: nothing has completed yet
    with pytest.raises(Rejected) as e:
        await adm.admit(Ticket(sla_ms=10))
    assert e.value.reason == "sla"
    (ok,) = await queued(adm, Ticket(sla_ms=1000))
    assert not ok.done()
    streaming.release("completed", tokens=10)
    (await ok).release("cancelled")


async def test_a_reloaded_admission_takes_over_the_registry():
    reg = Registry()
    adm, (ep,) = make(registry=reg)
    (await adm.admit(Ticket())).release("completed")
    adm2, _ = make(registry=reg)  # SIGHUP: new settings, same registry
    (await adm2.admit(Ticket())).release("completed")
    assert adm2.stats()["counters"]["admitted"] == 1 and reconciles(adm2)
    assert "velocity_admitted_total 2.0" in reg.render().decode()


async def test_sla_miss_cuts_the_limit_only_when_the_engine_overran():
    clock = Clock()
    adm, (ep,) = make(limit=8, clock=clock)
    queued_long = await adm.admit(Ticket(sla_ms=1000))
    clock.t += 2.0  # late because of the gateway queue, say
    queued_long.bind(ep)
    clock.t += 0.1
    queued_long.first_byte()
    queued_long.release("completed", tokens=5)
    assert ep.limit == 8
    slow = await adm.admit(Ticket(sla_ms=1000))
    slow.bind(ep)
    clock.t += 0.1
    slow.first_byte()
    clock.t += 1.5  # the engine alone took longer than the whole SLA
    slow.release("completed", tokens=5)
    assert ep.limit == 6
    assert adm.stats()["sla"] == {"met": 0, "missed": 2, "compliance": 0.0}


# -- admission_core: the request path's typed classes ---------------------------------


def make_one(clock=time.monotonic, policy="dynamic"):
    ep = Endpoint("e0", "http://127.0.0.1:9000", "m")
    ep.healthy = True
    adm = Admission(
        AdmissionSettings(aimd_max=4, aimd_min=1),
        {"m": Pool("m", [ep])},
        policy=policy,
        registry=Registry(),
        clock=clock,
    )
    return adm, ep


def test_ewma_is_unknown_until_its_first_sample_then_moves_by_alpha():
    e = Ewma(0.5)
    assert e.value is None and e.samples == 0
    e.observe(2.0)
    assert e.value == 2.0
    e.observe(4.0)
    assert e.value == 3.0 and e.samples == 2


def test_service_estimate_predicts_nothing_until_it_has_seen_a_request():
    s = ServiceEstimate(1.0)
    assert not s.known and s.predict(10) is None
    assert s.snapshot() == {"ttft_ms": None, "tpot_ms": None, "service_ms": None, "samples": 0}
    s.observe(-1.0, 0.5, 10)  # no first byte seen: a whole answer, 0.05 s a token
    assert s.known and s.predict(10) == 0.5 and s.tpot.value == pytest.approx(0.05)
    assert s.predict(40) == pytest.approx(2.0)  # by its own size, not the last one's
    s.observe_first_byte(0.1)
    s.observe(0.1, 1.0, 10)  # a stream: 0.9 s over 9 tokens after the first
    assert s.predict(11) == pytest.approx(0.1 + 10 * 0.1)
    s.observe_first_byte(-1.0)  # a negative time is not learned
    assert s.ttft.samples == 1


def test_window_keeps_the_last_samples_oldest_first():
    w = Window(3)
    for x in range(5):
        w.append(float(x))
    assert list(w) == [2.0, 3.0, 4.0] and len(w) == 3
    assert percentiles(w, (50,)) == {"p50": 3000.0}
    empty = Window(0)
    empty.append(1.0)
    assert list(empty) == [] and percentiles(empty) == {}
    # Round the ring several times, ints taken as numbers: still the last three, in order.
    for x in range(5, 12):
        w.append(x)
    assert list(w) == [9.0, 10.0, 11.0] and len(w) == 3
    one = Window(1)
    assert list(one) == [] and len(one) == 0
    one.append(2.5)
    one.append(3.5)
    assert list(one) == [3.5]


async def test_a_release_with_an_unknown_outcome_is_refused_and_the_lease_stays_held():
    adm, ep = make_one()
    lease = await adm.admit(Ticket())
    lease.bind(ep)
    with pytest.raises(ValueError, match="outcome must be one of"):
        lease.release("maybe")
    assert not lease.done and ep.inflight == 1
    lease.release("cancelled")
    assert lease.done and ep.inflight == 0
    assert adm.stats()["counters"]["cancelled"] == 1


def test_ticket_defaults_count_as_vllm_does():
    t = Ticket(max_tokens=None, prompt_bytes=None)
    assert (t.band, t.tenant, t.sla_ms, t.max_tokens, t.prompt_bytes, t.model) == (None, None, None, 16, 0, None)
    with pytest.raises(ValueError):
        Ticket(max_tokens="many")


async def test_the_compiled_clock_is_the_process_monotonic_clock():
    # With time.monotonic the request path reads the clock in C: its readings must fall
    # between Python's, or queue times and TTFTs would mix two clocks.
    adm, ep = make_one()
    before = time.monotonic()
    lease = await adm.admit(Ticket())
    lease.bind(ep)
    lease.first_byte()
    after = time.monotonic()
    assert before <= lease.arrived_at <= lease.bound_at <= lease.first_byte_at <= after
    lease.release()


async def test_a_hand_driven_clock_is_still_obeyed():
    t = [500.0]
    adm, ep = make_one(clock=lambda: t[0])
    lease = await adm.admit(Ticket(sla_ms=100))
    assert lease.arrived_at == 500.0 and lease.deadline == pytest.approx(500.1)
    lease.bind(ep)
    t[0] = 500.25
    lease.first_byte()
    lease.release(tokens=4)
    stats = adm.stats()
    assert stats["sla"] == {"met": 0, "missed": 1, "compliance": 0.0}
    assert stats["latency_ms"]["ttft"]["p50"] == pytest.approx(250.0)


def test_service_estimate_scales_with_the_requests_own_size():
    """Short answers teach a rate per token that a long one is charged by; streams of
    prompts of two sizes teach the first token as a line in the prompt's bytes."""
    s = ServiceEstimate(0.2)
    for _ in range(6):
        s.observe(-1.0, 16 * 0.02, 16)  # short whole answers, 20 ms a token
    assert s.predict(60) == pytest.approx(60 * 0.02)
    assert s.predict(60) > 3 * s.service.value  # the mean of what was seen would be far short
    for _ in range(20):  # streams: 1 ms of prefill per 100 bytes
        for nbytes in (1000, 20000):
            ttft = 0.01 + nbytes * 1e-5
            s.observe_first_byte(ttft)
            s.observe(ttft, ttft + 15 * 0.02, 16, nbytes)
    assert s.predict(16, 1000) == pytest.approx(0.02 + 15 * 0.02, rel=0.02)
    assert s.predict(16, 20000) == pytest.approx(0.21 + 15 * 0.02, rel=0.02)
    # A whole answer after streams: the prefill its prompt costs is not charged per token.
    s.observe(-1.0, 0.21 + 16 * 0.02, 16, 20000)
    assert s.tpot.value == pytest.approx(0.02, rel=0.05)


async def test_an_idle_pool_grants_a_band_whose_ceiling_is_below_one_slot():
    """A ceiling of 0.05 on an engine of limit 8 is less than one slot: counting the grant
    itself, no request of that band would ever fit. With nothing in flight and nothing
    running, the pool grants one all the same (work-conserving); the second waits."""
    from velocity_fast.admission.settings import BandSettings

    adm, (ep,) = make(limit=8, bands=[BandSettings(name="high", ceiling=1.5), BandSettings(name="tiny", ceiling=0.05)])
    first = await asyncio.wait_for(adm.admit(Ticket(band="tiny")), 1)
    first.bind(ep)
    (second,) = await queued(adm, Ticket(band="tiny"))
    assert not second.done()
    first.release("completed")
    (await asyncio.wait_for(second, 1)).release("completed")


@pytest.mark.parametrize("borrow_after_ms, lows", [(60000.0, 9), (0.0, 8)])
async def test_low_work_alone_borrows_all_of_a_learned_batch_but_a_slot(borrow_after_ms, lows):
    """A minute with no higher band asking: low (no deadline, ceiling 0.8) keeps 9 of a
    learned batch of 10 running, not 8; ``borrow_after_ms: 0`` keeps it to its ceiling.
    The first high request then finds the slot free, and ends the borrowing: a low that
    ends is not replaced while low holds its ceiling's share or more."""
    clock = Clock()
    adm, (ep,) = make(limit=16, clock=clock, borrow_after_ms=borrow_after_ms)

    def scrape(running, waiting):
        scrape_engine(adm, ep, clock, running, waiting)

    first = [await adm.admit(Ticket()) for _ in range(12)]
    for le in first:
        le.bind(ep)
    scrape(10, 2)
    scrape(10, 2)
    assert adm.stats()["endpoints"]["e0"]["batch_capacity"] == 10
    for le in first:
        le.release("cancelled")
    clock.t += 61.0
    scrape(0, 0)
    tasks = await queued(adm, *[Ticket(band="low") for _ in range(30)])
    running = []

    async def settle():
        """Bind what was granted, then let each end once: what is granted in its place
        is what the band may keep running."""
        for _ in range(3):
            for t in tasks:
                if t.done() and t.result() not in running:
                    running.append(t.result())
                    t.result().bind(ep)
            await asyncio.sleep(0)

    await settle()
    for le in list(running):
        if not le.done:
            le.release("completed")
            await settle()
    assert ep.inflight == lows
    high = await asyncio.wait_for(adm.admit(Ticket(band="high")), 1)
    assert high.queue_ms == 0.0
    high.bind(ep)
    ended = next(le for le in running if not le.done)
    ended.release("completed")
    await settle()
    # Borrowing ended with the high request: no low took the freed slot.
    assert ep.inflight == lows
    high.release("completed")
    for le in running:
        le.release("cancelled")
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_engines_probe_for_their_batch_one_at_a_time_and_high_avoids_the_overshoot():
    """Before their batches are learned, only the first engine grows its limit; the
    second keeps its starting one (low holds 0.7 of it, leaving slots for high) until the
    first is learned and shows no queue. High work is not sent to an engine queueing
    before its batch is learned while another has room."""
    clock = Clock()
    adm, eps = make(n=2, limit=32, clock=clock, aimd_initial=8)
    e0, e1 = eps
    tasks = [asyncio.create_task(adm.admit(Ticket(band="low"))) for _ in range(80)]
    bound = []

    async def bind_new():
        """Bind what was granted, as the router would, until nothing more is granted."""
        while True:
            await asyncio.sleep(0)
            new = [t.result() for t in tasks if t.done() and t.result() not in bound]
            if not new:
                return
            for le in new:
                le.bind(next(e for e in eps if le.has_room(e)))
                bound.append(le)

    async def scrape(ep, running, waiting):
        scrape_engine(adm, ep, clock, running, waiting)
        await bind_new()

    await bind_new()
    assert (e0.limit, e1.limit) == (8, 8) and (e0.inflight, e1.inflight) == (5, 5)  # 0.7 of 8 each
    for _ in range(3):  # e0 runs all it is sent: its slow start goes on, e1's waits its turn
        await scrape(e0, e0.inflight, 0)
        await scrape(e1, e1.inflight, 0)
    assert e0.limit > 18 and e1.limit == 8 and e1.inflight == 5
    # e0 overshoots its batch of 16: it queues, and is learned a scrape later.
    await scrape(e0, 16, e0.inflight - 16)
    high = await adm.admit(Ticket(band="high"))
    assert not high.has_room(e0) and high.has_room(e1)  # not behind e0's overshoot
    await scrape(e0, 16, e0.inflight - 16)
    assert adm.stats()["endpoints"]["e0"]["batch_capacity"] == 16
    await scrape(e1, e1.inflight, 0)
    assert e1.limit == 8  # e0 still has low work waiting in it: not yet e1's turn
    for le in [le for le in bound if le.endpoint is e0][: e0.inflight - 16]:
        le.release("completed")
    await scrape(e0, 16, 0)
    await scrape(e1, e1.inflight, 0)
    assert e1.limit == 12  # e0 learned, its queue gone: e1 probes now
    high.release("cancelled")
    for le in bound:
        le.release("cancelled")
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    adm.close()
