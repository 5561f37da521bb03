"""The router's named filters (velocity_fast/routing/filters.pyx) and the load scorer
(routing/load.pyx), each asked on its own; tests/routing/test_router.py holds them
together in the router (order, fail open, full after free)."""

import time

from tests.support.fleet import make_pool
from velocity_fast.fleet.endpoint import RoomFilter
from velocity_fast.routing.filters import Excluded, Full, NoRoom, Saturated, Unhealthy, make_filters
from velocity_fast.routing.load import EngineLoad
from velocity_fast.routing.plugins import VERDICTS, Pick
from velocity_fast.routing.settings import RoutingSettings


def _verdict(f, ep, pick):
    return VERDICTS[f.check(ep, pick)]


def _pick(**kw):
    p = Pick(2.0)
    p.now = time.monotonic()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def test_the_router_asks_them_in_this_order():
    filters = make_filters(RoutingSettings(saturation_waiting=3.0, saturation_kv=0.9))
    assert [f.name for f in filters] == ["unhealthy", "no-room", "excluded", "saturated", "full"]
    sat = filters[3]
    assert (sat.waiting, sat.kv) == (3.0, 0.9)


def test_unhealthy_drops_and_keeps():
    a, b = make_pool(2).endpoints
    b.healthy = False
    assert _verdict(Unhealthy(), a, _pick()) == "keep"
    assert _verdict(Unhealthy(), b, _pick()) == "drop"


def test_no_room_asks_the_callable_or_the_room_filter_as_c():
    a, b = make_pool(2).endpoints
    assert _verdict(NoRoom(), a, _pick()) == "keep"  # no has_room: all have room
    room = lambda ep: ep is a  # noqa: E731
    assert _verdict(NoRoom(), a, _pick(has_room=room)) == "keep"
    assert _verdict(NoRoom(), b, _pick(has_room=room)) == "drop"
    assert _verdict(NoRoom(), b, _pick(room_filter=RoomFilter())) == "keep"  # the base filter has room everywhere


def test_excluded_takes_any_container():
    a, b = make_pool(2).endpoints
    for exclude in ([b], (b,), {b}):
        assert _verdict(Excluded(), a, _pick(exclude=exclude)) == "keep"
        assert _verdict(Excluded(), b, _pick(exclude=exclude)) == "drop"


def test_saturated_reads_fresh_gauges_only():
    (a,) = make_pool(1).endpoints
    f = Saturated(5.0, 0.8)
    a.waiting, a.scraped_at = 5.0, time.monotonic()
    assert _verdict(f, a, _pick()) == "saturated"
    a.waiting, a.kv_usage = 0.0, 0.8
    assert _verdict(f, a, _pick()) == "saturated"
    a.kv_usage = 0.5
    assert _verdict(f, a, _pick()) == "keep"
    a.waiting, a.scraped_at = 9.0, time.monotonic() - 10.0  # stale: not read
    assert _verdict(f, a, _pick()) == "keep"


def test_full_counts_other_replicas_against_the_learned_batch():
    (a,) = make_pool(1).endpoints
    assert _verdict(Full(), a, _pick()) == "keep"  # no batch learned
    a.running_cap, a.inflight = 4.0, 3
    assert _verdict(Full(), a, _pick()) == "keep"
    a.others = 1.0
    assert _verdict(Full(), a, _pick()) == "full"


def test_the_load_is_engine_waiting_on_fresh_gauges_plus_gateway_in_flight():
    (a,) = make_pool(1).endpoints
    a.inflight, a.waiting = 3, 2.0
    assert EngineLoad().score(a, _pick()) == 3.0  # never scraped
    a.scraped_at = time.monotonic()
    assert EngineLoad().score(a, _pick()) == 5.0
    assert _pick().fresh(a)
