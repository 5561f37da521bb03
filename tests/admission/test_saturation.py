"""Saturation: per endpoint and per pool, both lags closed, stale metrics tolerated."""

import math

import pytest

from velocity_fast.admission.saturation import EndpointLoad, Saturation, free_slots, observe_endpoint, refresh
from velocity_fast.fleet.endpoint import Endpoint


def test_worse_of_queue_and_kv():
    s = Saturation()
    e = EndpointLoad(limit=32)
    assert s.update(e, 4, 5, 0.2, 10.0, 10.0) == pytest.approx(1.0)
    assert s.update(e, 4, 1, 0.6, 10.0, 10.0) == pytest.approx(0.75)
    assert e.value == pytest.approx(0.75)


def test_use_of_the_limit_is_a_term():
    s = Saturation()
    e = EndpointLoad(limit=10)
    e.inflight = 8
    assert s.endpoint(e, 0.0) == pytest.approx(0.8)
    assert s.endpoint(e, 0.0, 2.0) == pytest.approx(1.0)


def test_inflight_beyond_learned_capacity_counts_as_queued():
    s = Saturation()
    e = EndpointLoad(limit=64)
    s.update(e, 8, 2, 0.1, 0.9, 0.9)
    s.update(e, 8, 2, 0.1, 1.0, 1.0)  # a queue shows twice: 8 is the batch capacity
    assert e.capacity == 8 and e.capacity_known
    e.inflight = 18  # the scrape still says 2 waiting, but 10 of ours queue
    # 10 queued / 5 = 2.0, and 18 in flight of a batch of 8 = 2.25: the batch bounds it.
    assert s.endpoint(e, 1.05) == pytest.approx(18 / 8)


def test_band_ceilings_are_shares_of_the_learned_batch_not_of_the_limit():
    """An engine whose batch (8) is far below the gateway's limit (32): once a scrape has
    shown its queue, in-flight is held against the batch, so a ceiling of 0.8 lets a band
    take 6 of its 8 slots, not 25 of 32 (most of which would wait in the engine's FIFO)."""
    s = Saturation()
    e = EndpointLoad(limit=32)
    e.inflight = 6
    assert s.endpoint(e, 1.0) == pytest.approx(6 / 32)  # cold: the limit stands in
    s.update(e, 8, 2, 0.1, 0.9, 0.9)
    s.update(e, 8, 2, 0.1, 1.0, 1.0)
    assert s.endpoint(e, 1.0) == pytest.approx(6 / 8)  # below a low ceiling of 0.8
    e.inflight = 7
    assert s.endpoint(e, 1.0) > 0.8  # a seventh would eat the headroom of higher bands
    # A limit below the batch still counts: the smaller of the two.
    big = EndpointLoad(limit=4)
    s.update(big, 16, 2, 0.1, 0.9, 0.9)
    s.update(big, 16, 2, 0.1, 1.0, 1.0)
    big.inflight = 2
    assert s.endpoint(big, 1.0) == pytest.approx(0.5)


def test_a_queue_in_one_scrape_is_not_proof_of_the_batch():
    """A burst's requests wait for the engine's next step: one scrape with a queue beside
    10 running must not cap a 256-sequence engine at 10, nor the request that a steady
    stream leaves waiting in most scrapes, nor a batch that ended together and waits to
    be replaced (fewer running than ever). Two real queues in a row do."""
    s = Saturation()
    e = EndpointLoad(limit=32)
    s.update(e, 10, 3, 0.1, 1.0, 1.0)
    s.update(e, 20, 0, 0.1, 1.1, 1.1)
    assert not e.capacity_known
    e.inflight = 20
    assert s.endpoint(e, 1.1) == pytest.approx(20 / 32)
    for t in (1.12, 1.14, 1.16):
        s.update(e, 20, 1, 0.1, t, t)
    for t in (1.18, 1.19):
        s.update(e, 15, 5, 0.1, t, t)  # five ended together; their successors wait a step
    assert not e.capacity_known
    s.update(e, 24, 4, 0.1, 1.2, 1.2)
    s.update(e, 24, 5, 0.1, 1.3, 1.3)
    assert e.capacity_known and e.capacity == 24


def test_a_long_prefill_step_is_not_proof_of_the_batch():
    """A fresh engine's first cold prompt: one prefill step of 200 ms or more spans two
    scrapes, with the requests that arrived during it waiting and one running. Nothing was
    decoded in between (no step ended), so the queue proves nothing: the batch stays
    unknown (a fresh engine of 8 learned 1 that way, and was held at it for good). Nor
    does a step that took the queue in (running grew). A queue that a step in which every
    running sequence decoded left waiting, beside as many running, is the ceiling; an
    engine without the inter-token histogram (decoded unknown) keeps the two-scrape rule."""
    e = EndpointLoad(limit=8)
    e.observe(1, 3, 0.1, 1.0, 0.0)
    e.observe(1, 4, 0.1, 1.1, 0.0)  # the same prefill step: nothing decoded
    assert not e.capacity_known
    e.observe(3, 2, 0.1, 1.2, 1.0)  # it ended: two of the queue joined, two more arrived
    e.observe(5, 2, 0.1, 1.3, 3.0)  # the next step took more in: running grew
    assert not e.capacity_known
    e.observe(8, 3, 0.2, 1.4, 5.0)
    e.observe(8, 3, 0.2, 1.5, 40.0)  # five steps of 8, the queue still there beside 8
    assert e.capacity_known and e.capacity == 8
    old = EndpointLoad(limit=8)
    old.observe(2, 3, 0.1, 1.0)
    old.observe(2, 3, 0.1, 1.1)
    assert old.capacity_known and old.capacity == 2


def test_the_scrape_hands_saturation_what_the_engine_decoded():
    """observe_endpoint passes the endpoint's ``decoded`` (set by the health checker from
    the inter-token histogram) to the load: no step between two scrapes, no batch learned."""
    ep = Endpoint("a", "http://127.0.0.1:1", "m", limit=8)
    load = EndpointLoad(limit=8)
    for t in (1.0, 1.1):
        ep.running, ep.waiting, ep.scraped_at, ep.decoded = 1.0, 4.0, t, 0.0
        observe_endpoint(load, ep)
    assert not load.capacity_known
    for t, decoded in ((1.2, 8.0), (1.3, 40.0)):
        ep.running, ep.waiting, ep.scraped_at, ep.decoded = 8.0, 3.0, t, decoded
        observe_endpoint(load, ep)
    assert load.capacity_known and load.capacity == 8


def test_cold_endpoint_uses_limit_as_capacity():
    s = Saturation()
    e = EndpointLoad(limit=100)
    s.update(e, 2, 0, 0.0, 1.0, 1.0)
    e.inflight = 40  # a small early high-water mark (2) does not make this queue
    assert s.endpoint(e, 1.0) == pytest.approx(0.4)  # only the use of the limit
    e.inflight = 110
    assert s.endpoint(e, 1.0) == pytest.approx(2.0)


def test_stale_metrics_fall_back_to_own_counts():
    s = Saturation(stale_after=1.0)
    e = EndpointLoad(limit=4)
    s.update(e, 4, 50, 0.99, 1.0, 1.0)
    assert s.endpoint(e, 1.5) >= 10
    # Ten seconds later the scrape is stale: only the gateway's own count matters.
    e.inflight = 2
    assert s.endpoint(e, 11.0) == pytest.approx(0.5)  # half the limit, nothing queued
    never = EndpointLoad(limit=4)
    assert s.endpoint(never, 5.0) == 0.0


def test_pool_is_not_held_back_by_one_hot_endpoint():
    s = Saturation()
    hot, cool = EndpointLoad(limit=8), EndpointLoad(limit=8)
    s.update(hot, 8, 40, 0.95, 1.0, 1.0)
    s.update(cool, 1, 0, 0.1, 1.0, 1.0)
    assert s.pool([hot, cool], 0, 1.0) < 0.2
    cool.healthy = False
    assert s.pool([hot, cool], 0, 1.0) > 5


def test_pool_counts_outstanding_leases():
    s = Saturation()
    a, b = EndpointLoad(limit=40), EndpointLoad(limit=40)
    assert s.pool([a, b], 0, 1.0) == 0.0
    # 20 granted, not yet bound: any one endpoint may get them all, half its limit.
    assert s.pool([a, b], 20, 1.0) == pytest.approx(0.5)
    for t in (0.9, 1.0):
        s.update(a, 4, 2, 0.0, t, t)
        s.update(b, 4, 2, 0.0, t, t)  # both have shown a batch capacity of 4
    # 20 on a batch of 4: 16 would queue (16/5), and 20 of 4 is the larger term.
    assert s.pool([a, b], 20, 1.0) == pytest.approx(20 / 4)


def test_pool_prefers_endpoints_with_room_and_is_infinite_without_health():
    s = Saturation()
    full, free = EndpointLoad(limit=2), EndpointLoad(limit=2)
    full.inflight = 2
    s.update(full, 2, 0, 0.0, 1.0, 1.0)
    s.update(free, 0, 3, 0.0, 1.0, 1.0)
    assert s.pool([full, free], 0, 1.0) == pytest.approx(0.6)
    free.inflight = 2
    assert s.pool([full, free], 0, 1.0) == pytest.approx(1.0)  # all full: all count
    full.healthy = free.healthy = False
    assert math.isinf(s.pool([full, free], 0, 1.0))
    assert math.isinf(s.pool([], 0, 1.0))


def test_thresholds_are_configurable_and_positive():
    s = Saturation(queue_threshold=10, kv_threshold=0.5)
    e = EndpointLoad()
    assert s.update(e, 1, 5, 0.4, 1.0, 1.0) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        Saturation(queue_threshold=0)


def test_refresh_copies_the_gateway_counts_and_only_a_new_scrape():
    a, b = Endpoint("a", "http://a", "m", limit=8), Endpoint("b", "http://b", "m", limit=4)
    la, lb = EndpointLoad(limit=1), EndpointLoad(limit=1)
    a.healthy, a.inflight = True, 3
    a.running, a.waiting, a.kv_usage, a.scraped_at = 6, 2, 0.5, 10.0
    assert refresh([la, lb], [a, b]) is True  # a is healthy, b is not
    assert (la.healthy, la.inflight, la.limit) == (True, 3, 8)
    assert (la.running, la.waiting, la.kv, la.scraped_at) == (6, 2, 0.5, 10.0)
    assert (lb.healthy, lb.limit, lb.scraped_at) == (False, 4, 0.0)
    a.running = 7  # the same scrape: the gauges are not read again
    refresh([la, lb], [a, b])
    assert la.running == 6 and la.capacity == 6
    a.scraped_at = 11.0
    refresh([la, lb], [a, b])
    assert la.running == 7 and la.capacity == 7
    a.healthy = False
    assert refresh([la, lb], [a, b]) is False
    assert refresh([], []) is False
    with pytest.raises(ValueError):
        refresh([la], [a, b])


def test_other_replicas_work_is_what_the_engine_shows_beyond_our_own_peak():
    """Two gateways in front of one engine: each sees the other's requests only in the
    engine's gauges. What the engine runs beyond the most this gateway had in
    flight since the scrape before is the other's, and counts as in-flight work."""
    s = Saturation()
    ep = Endpoint("a", "http://a", "m", limit=10)
    ep.healthy = True
    load = EndpointLoad(limit=10)
    ep.inflight = ep.inflight_peak = 4
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 10, 1, 0.1, 10.0
    refresh([load], [ep])
    assert load.others == 6 and ep.others == 6
    # Ours 4 and theirs 6 of a limit of 10: full, where ours alone would be 0.4.
    assert s.endpoint(load, 10.05) == pytest.approx(1.0)
    # A scrape that is stale is no evidence of the others: our own count stands alone.
    assert s.endpoint(load, 100.0) == pytest.approx(0.4)


def test_a_single_gateway_sees_no_others_however_its_count_moved_between_scrapes():
    # Six of ours ran when the engine was scraped; two ended since. The engine's six are
    # all ours: the peak since the last scrape, not the count now, is subtracted.
    ep = Endpoint("a", "http://a", "m", limit=10)
    ep.healthy = True
    load = EndpointLoad(limit=10)
    ep.inflight = ep.inflight_peak = 6
    ep.inflight = 4
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 6, 0, 0.1, 10.0
    observe_endpoint(load, ep)
    assert load.others == 0
    assert ep.inflight_peak == 4  # the next interval's peak starts from the count now


def test_others_is_the_most_of_the_last_three_scrapes_so_a_batch_boundary_dip_opens_no_gap():
    # Another replica keeps 7 on the engine beside our 8. One scrape lands while a batch
    # has just ended (the engine replaces it a step later) and shows 11 running, not 15:
    # read alone, others would be 3 and we would fill the 4 slots that are not free.
    ep = Endpoint("a", "http://a", "m", limit=16)
    ep.healthy = True
    load = EndpointLoad(limit=16)
    readings = []
    for t, running in enumerate([15, 15, 11, 15, 11, 9, 9, 9]):
        ep.inflight = ep.inflight_peak = 8
        ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = running, 0, 0.1, 10.0 + t
        observe_endpoint(load, ep)
        readings.append(load.others)
    # The dips are held at 7; the other replica's real drop (to 1) shows three scrapes on.
    assert readings == [7, 7, 7, 7, 7, 7, 3, 1]
    assert ep.others == 1


def test_free_slots_count_healthy_endpoints_below_their_limit_less_pending():
    a, b, c = (Endpoint(n, f"http://{n}", "m", limit=8) for n in "abc")
    a.healthy, a.inflight = True, 5  # 3 free
    b.healthy, b.inflight = True, 10  # over its limit: counts 0, not -2
    c.healthy, c.inflight = False, 0  # unhealthy: counts 0
    assert free_slots([a, b, c], 0) == 3
    assert free_slots([a, b, c], 2) == 1
    assert free_slots([a, b, c], 5) == -2
    assert free_slots([], 1) == -1


def test_the_kv_its_requests_will_still_decode_counts_before_the_cache_fills():
    """A KV-bound engine whose cache is nearly empty now (0.1) with 10 batch requests
    bound there that will each decode 200 tokens: 2000 of its 4096 token slots are
    coming, so the cache as it will be (0.1 + 0.49) over 0.95 is the saturation, not the
    usage's 0.1 / 0.8. As the engine decodes (its pace: 20 ms a token), that part shrinks."""
    s = Saturation()
    e = EndpointLoad(limit=64)
    s.update(e, 10, 0, 0.1, 10.0, 10.0)
    e.inflight = 10
    assert s.endpoint(e, 10.0) == pytest.approx(max(10 / 64, 0.1 / 0.8))  # nothing known of what is coming
    e.kv_tokens = 256 * 16
    for _ in range(10):  # bound together: they end together, and then hold all 2000 at once
        e.bind_work(200.0, 10.0, 1.0)
    assert e.kv_ahead(10.0) == pytest.approx(2000 / 4096)
    low = 0.8 / 0.7  # the low band's ceiling over its soft ceiling
    assert s.endpoint(e, 10.0, 0.0, low) == pytest.approx((0.1 + 2000 / 4096) / 0.95)
    e.out_share = 0.5  # answers here end at half their max_tokens
    assert e.kv_ahead(10.0) == pytest.approx(1000 / 4096)
    e.out_share = 1.0
    e.pace = 0.02  # 1 s later each has decoded 50 of its 200 (the usage gauge is not refreshed here)
    assert e.kv_ahead(11.0) == pytest.approx(1500 / 4096)
    assert e.kv_ahead(100.0) == 0.0  # past what they may decode: nothing more coming


def test_batch_work_is_held_by_the_cache_as_it_will_be_not_by_a_guess_from_the_gauge():
    """Five low requests of 200 tokens bound to a KV-bound engine 2 s ago have decoded half
    their answers: the gauge reads 0.58 of the cache, and 500 more tokens are coming (0.70
    at the peak, under low's 0.76). The gauge weighed as a guess (0.58 / 0.8 x 0.8 / 0.7 =
    0.83) would hold low back past its ceiling of 0.8, though the projection, which starts
    from the same gauge, leaves it room: low then stopped each time its work had decoded
    halfway, and bound its next wave when that work ended. Where nothing is projected, and
    for the bands with a deadline, the gauge still counts."""
    s = Saturation()
    e = EndpointLoad(limit=64)
    s.update(e, 5, 0, 0.58, 10.0, 10.0)
    e.inflight = 5
    low = 0.8 / 0.7  # the low band's ceiling over its soft ceiling
    assert s.endpoint(e, 10.0, 0.0, low) == pytest.approx(0.58 / 0.8 * low)  # nothing projected
    e.kv_tokens = 256 * 16
    e.pace = 0.02
    for _ in range(5):
        e.bind_work(200.0, 8.0, 1.0)
    peak = e.kv_peak(-1.0, 0.0)
    assert 0.68 < peak < 0.76
    assert s.endpoint(e, 10.0, 0.0, low) == pytest.approx(peak / 0.95)
    assert s.endpoint(e, 10.0, 0.0, low) <= 0.8  # room for low within its ceiling
    # Normal's saturation still counts the gauge (its work is not projected).
    assert s.endpoint(e, 10.0, 0.0, 1.0) == pytest.approx(max(0.58 / 0.8, peak / 0.95))


def test_batch_work_on_an_engine_its_cache_holds_is_not_held_to_a_guessed_batch():
    """An engine of unlearned batch (limit 32) whose KV cache holds it: 24 low requests of
    200 tokens bound there at 0.65 of the cache, 1,300 tokens still to come. The limit
    stands in for a batch the cache never lets it reach, and held to low's soft ceiling
    (24 / 32 x 0.8 / 0.7 = 0.86, past low's 0.8) it kept batch work at 22 in flight where
    the pace aims at 24: 0.87x `static`'s requests/s beside high traffic, 0.96x since. The
    projected cache bounds it there. Where the cache does not hold the engine, and for a
    band with a deadline, the limit is still weighed as the guess it is."""
    s = Saturation()
    low = 0.8 / 0.7  # the low band's ceiling over its soft ceiling
    e = EndpointLoad(limit=32)
    s.update(e, 24, 0, 0.65, 10.0, 10.0)
    e.inflight = 24
    e.kv_tokens = 256 * 16
    e.pace = 0.02
    for i in range(24):
        e.bind_work(200.0, 10.0 - 0.2 * (i + 1), 1.0)  # one every 0.2 s: 10 to 190 tokens decoded
    assert e.kv + e.kv_ahead(10.0) >= 0.7 * 0.95  # the cache holds it
    sat = s.endpoint(e, 10.0, 0.0, low)
    assert sat == pytest.approx(max(24 / 32, e.kv_peak(-1.0, 0.0) / 0.95))
    assert sat < 24 / 32 * low
    # Normal (no soft ceiling of its own, and the gauge counts for it): unchanged.
    assert s.endpoint(e, 10.0, 0.0, 1.0) >= 24 / 32
    # A cache far from full (the same count, nothing much coming): the limit is a guess.
    f = EndpointLoad(limit=32)
    s.update(f, 24, 0, 0.1, 10.0, 10.0)
    f.inflight = 24
    f.kv_tokens = 100000 * 16
    f.pace = 0.02
    for i in range(24):
        f.bind_work(200.0, 10.0 - 0.2 * (i + 1), 1.0)
    assert s.endpoint(f, 10.0, 0.0, low) == pytest.approx(24 / 32 * low)


async def test_admission_keeps_each_engines_bound_decode_from_bind_to_release():
    """The sums kv_ahead reads follow the leases: three low requests of 800 tokens bound
    to a KV-bound engine (256 blocks of 16) show as 2400 of its 4096 token slots coming
    (no pace known yet), a fourth would pass the low band's share of the cache as it will
    be, and once they are released nothing is coming."""
    import asyncio

    from velocity_fast.admission.controller import Admission, Ticket
    from velocity_fast.admission.settings import AdmissionSettings
    from velocity_fast.fleet.endpoint import Pool

    t = [1000.0]
    ep = Endpoint("e1", "http://127.0.0.1:9001", "m")
    ep.healthy = True
    ep.num_gpu_blocks, ep.block_size = 256, 16
    adm = Admission(AdmissionSettings(aimd_max=64, aimd_initial=0), {"m": Pool("m", [ep])}, clock=lambda: t[0])
    ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = 0.0, 0.0, 0.1, t[0]
    adm.on_metrics(ep)
    leases = []
    for _ in range(3):
        # Batch requests are bound one at a time, as the cache takes them (batch_interval):
        # the clock moves past each one's turn.
        t[0] += 30.0
        ep.scraped_at = t[0]
        adm.on_metrics(ep)
        leases.append(await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=800)), 1.0))
        leases[-1].bind(ep)
    assert adm.stats()["endpoints"]["e1"]["kv_ahead"] == pytest.approx(2400 / 4096, abs=1e-4)
    # Work with a deadline is not counted in it: its clients often ask for far more
    # max_tokens than the answer takes.
    normal = await adm.admit(Ticket(band="normal", max_tokens=4000))
    normal.bind(ep)
    assert adm.stats()["endpoints"]["e1"]["kv_ahead"] == pytest.approx(2400 / 4096, abs=1e-4)
    normal.release("completed")
    # 0.1 + 3200/4096 over 0.95 is past the low band's ceiling (0.8): a fourth low one
    # waits in the gateway's queue; a high one (ceiling 1.5) is granted at once.
    t[0] += 30.0
    ep.scraped_at = t[0]
    adm.on_metrics(ep)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(adm.admit(Ticket(band="low", max_tokens=800)), 0.05)
    high = await asyncio.wait_for(adm.admit(Ticket(band="high", max_tokens=1000)), 1.0)
    assert high.has_room(ep)
    high.release("cancelled")
    for lease in leases:
        lease.release("completed")
    assert adm.stats()["endpoints"]["e1"]["kv_ahead"] == 0.0
