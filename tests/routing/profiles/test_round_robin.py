"""The round-robin profile (velocity_fast/routing/profiles/round_robin.pyx): endpoints in
turn, in pool order, whatever their load."""

import time

from tests.support.fleet import make_pool, make_router


def router(**kw):
    return make_router(**{"seed": 5, **kw})


def picks(r, pool, info, n, has_room=None):
    return [r.pick(pool, info, has_room).name for _ in range(n)]


def test_round_robin_serves_the_endpoints_in_turn_whatever_their_load():
    pool = make_pool(4)
    e0 = pool.endpoints[0]
    e0.inflight, e0.waiting, e0.scraped_at = 30, 4.0, time.monotonic()  # loaded, not saturated
    r = router(default_profile="round-robin")
    info = r.route_info("m", {"prompt": "shared prefix " * 50}, {})
    assert info.profile == "round-robin"
    assert picks(r, pool, info, 12) == ["e0", "e1", "e2", "e3"] * 3
    assert r.stats()["picks"] == {"round-robin": {"turn": 12}}


def test_round_robin_skips_what_the_filters_remove_and_keeps_its_turn():
    pool = make_pool(4)
    r = router(default_profile="round-robin")
    info = r.route_info("m", {"prompt": "x"}, {})
    full = {"e1"}
    room = lambda ep: ep.name not in full  # noqa: E731
    assert picks(r, pool, info, 5, room) == ["e0", "e2", "e3", "e0", "e2"]
    full.clear()  # e1 has room again: the turn goes on from e2
    assert picks(r, pool, info, 4, room) == ["e3", "e0", "e1", "e2"]
    pool.endpoints[3].healthy = False
    assert picks(r, pool, info, 3) == ["e0", "e1", "e2"]
