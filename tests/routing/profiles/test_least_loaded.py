"""The least-loaded profile (velocity_fast/routing/profiles/least_loaded.pyx): the fewest
requests in flight from this gateway; the engines' gauges are not read."""

import time
from collections import Counter

from tests.support.fleet import make_pool, make_router


def router(**kw):
    return make_router(**{"seed": 5, **kw})


def picks(r, pool, info, n, has_room=None):
    return [r.pick(pool, info, has_room).name for _ in range(n)]


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
