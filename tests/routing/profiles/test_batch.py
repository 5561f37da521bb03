"""The batch profile (velocity_fast/routing/profiles/batch.pyx): the shortest queue."""

from tests.support.fleet import make_pool, scrape
from tests.support.fleet import make_router as router


def chat(user):
    return {"messages": [{"role": "user", "content": user}]}


def test_batch_takes_the_shortest_queue():
    pool = make_pool(4)
    for ep, (waiting, inflight) in zip(pool.endpoints, [(3, 2), (0, 4), (1, 1), (2, 2)]):
        scrape(ep, waiting=waiting)
        ep.inflight = inflight
    r = router(default_profile="batch")
    info = r.route_info("m", chat("x"), {})
    assert {r.pick(pool, info).name for _ in range(50)} == {"e2"}
