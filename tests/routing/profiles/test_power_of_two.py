"""The power-of-two profile (velocity_fast/routing/profiles/power_of_two.pyx): two
candidates drawn at random, the less loaded takes the request. The functional suite
(tests/routing/test_profiles.py) holds it to what every profile must do."""

import random
import time
from collections import Counter

from tests.support.fleet import make_pool, make_router
from velocity_fast.routing.profiles.power_of_two import PowerOfTwoProfile
from velocity_fast.routing.route import RouterPool
from velocity_fast.routing.settings import RoutingSettings


def router(**kw):
    return make_router(**{"seed": 11, **kw})


def loaded_pool(inflight):
    pool = make_pool(len(inflight))
    for ep, n in zip(pool.endpoints, inflight):
        ep.inflight = n
    return pool


def test_of_two_the_less_loaded_takes_it_every_time():
    pool = loaded_pool((5, 2))
    r = router(default_profile="power-of-two")
    info = r.route_info("m", {"prompt": "x"}, {})
    assert {r.pick(pool, info).name for _ in range(50)} == {"e1"}
    assert r.stats()["picks"] == {"power-of-two": {"load": 50}}


def test_the_draw_decides_among_more_and_the_most_loaded_never_wins():
    pool = loaded_pool((0, 1, 2, 9))
    r = router(default_profile="power-of-two")
    info = r.route_info("m", {"prompt": "x"}, {})
    counts = Counter(r.pick(pool, info).name for _ in range(3000))
    # A candidate wins when drawn with a more loaded one: of the 6 pairs, e0 wins 3, e1 2, e2 1.
    assert "e3" not in counts
    assert counts["e0"] > counts["e1"] > counts["e2"] > 0
    assert abs(counts["e0"] / 3000 - 3 / 6) < 0.05 and abs(counts["e2"] / 3000 - 1 / 6) < 0.05


def test_the_load_counts_the_engine_queue_on_fresh_gauges():
    pool = loaded_pool((1, 2))
    pool.endpoints[0].waiting, pool.endpoints[0].scraped_at = 3.0, time.monotonic()  # 1 + 3 against 2
    r = router(default_profile="power-of-two")
    info = r.route_info("m", {"prompt": "x"}, {})
    assert {r.pick(pool, info).name for _ in range(30)} == {"e1"}


def test_chosen_by_header_and_only_among_endpoints_with_room():
    pool = loaded_pool((0, 0, 0, 0))
    r = router()
    info = r.route_info("m", {"prompt": "x"}, {"x-velocity-profile": "power-of-two"})
    assert info.profile == "power-of-two"
    room = lambda ep: ep.name != "e0"  # noqa: E731
    counts = Counter(r.pick(pool, info, room).name for _ in range(300))
    assert set(counts) == {"e1", "e2", "e3"} and min(counts.values()) > 60


def test_decide_gives_the_position_and_the_basis():
    pool = loaded_pool((4, 1, 7))
    p = PowerOfTwoProfile(RoutingSettings(), random.Random(3))
    state = RouterPool(pool, RoutingSettings())
    info = router().route_info("m", {"prompt": "x"}, {})
    seen = Counter(p.decide(pool.endpoints, [4.0, 1.0, 7.0], info, state) for _ in range(200))
    assert set(seen) == {(0, "load"), (1, "load")}  # e2 (the most loaded) never
