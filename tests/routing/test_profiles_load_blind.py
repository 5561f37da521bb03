"""The load-blind routing profiles, round-robin and least-loaded (routing/router.pyx):
chosen per model in the config or per request with x-velocity-profile."""

import re
import time
from collections import Counter

from tests.support.fleet import make_pool
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings



def router(**kw):
    kw.setdefault("seed", 5)
    return Router(RoutingSettings(**kw), registry=Registry())


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


def test_least_loaded_picks_the_fewest_in_flight_and_ignores_the_engine_queue():
    pool = make_pool(4)
    now = time.monotonic()
    for ep, inflight, waiting in zip(pool.endpoints, (5, 2, 7, 3), (0, 4, 0, 0)):
        ep.inflight, ep.waiting, ep.scraped_at = inflight, float(waiting), now
    info_of = lambda r: r.route_info("m", {"prompt": "x"}, {})  # noqa: E731
    r = router(default_profile="least-loaded")
    assert set(picks(r, pool, info_of(r), 30)) == {"e1"}
    assert r.stats()["picks"] == {"least-loaded": {"load": 30}}
    # batch counts the engine's queue too (2 + 4 against 3 + 0): the two differ here.
    b = router(default_profile="batch")
    assert set(picks(b, pool, info_of(b), 30)) == {"e3"}


def test_least_loaded_breaks_ties_at_random_and_follows_dispatches():
    pool = make_pool(3)
    pool.endpoints[0].inflight = 4
    r = router(default_profile="least-loaded")
    info = r.route_info("m", {"prompt": "x"}, {})
    counts = Counter(picks(r, pool, info, 400))
    assert set(counts) == {"e1", "e2"} and min(counts.values()) > 120
    # Requests sent raise the in-flight count: picks that hold their request spread out.
    for ep in pool.endpoints:
        ep.inflight = 0
    held = []
    for _ in range(9):
        ep = r.pick(pool, info)
        ep.inflight += 1
        held.append(ep.name)
    assert Counter(held) == {"e0": 3, "e1": 3, "e2": 3}


def test_chosen_per_model_in_the_config_or_per_request_by_header():
    settings = RoutingSettings.from_config({"seed": 1}, {"rr": {"profile": "round-robin"},
                                                         "ll": {"profile": "least-loaded"}})
    r = Router(settings, registry=Registry())
    assert r.route_info("rr", {"prompt": "x"}, {}).profile == "round-robin"
    assert r.route_info("ll", {"prompt": "x"}, {}).profile == "least-loaded"
    assert r.route_info("other", {"prompt": "x"}, {}).profile == "chat"
    info = r.route_info("other", {"prompt": "x"}, {"x-velocity-profile": " Round-Robin "})
    assert info.profile == "round-robin"
    pool = make_pool(3, "other")
    assert picks(r, pool, info, 6) == ["e0", "e1", "e2"] * 2


def test_the_picks_show_in_the_metrics_by_profile_and_basis():
    reg = Registry()
    r = Router(RoutingSettings(default_profile="round-robin", seed=1), registry=reg)
    pool = make_pool(2)
    info = r.route_info("m", {"prompt": "x"}, {})
    picks(r, pool, info, 3)
    ll = r.route_info("m", {"prompt": "x"}, {"x-velocity-profile": "least-loaded"})
    picks(r, pool, ll, 2)
    text = reg.render().decode()
    assert re.search(r'^velocity_route_picks_total\{profile="round-robin",basis="turn"\} 3(\.0)?$', text, re.M)
    assert re.search(r'^velocity_route_picks_total\{profile="least-loaded",basis="load"\} 2(\.0)?$', text, re.M)
