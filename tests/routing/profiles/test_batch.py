"""The batch profile (velocity_fast/routing/profiles/batch.pyx): the shortest queue."""

import time

from tests.support.fleet import make_pool
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings


def scrape(ep, *, waiting=0.0, running=0.0, kv=0.0, at=None):
    ep.waiting, ep.running, ep.kv_usage = float(waiting), float(running), kv
    ep.scraped_at = time.monotonic() if at is None else at


def router(**kw):
    kw.setdefault("seed", 7)
    return Router(RoutingSettings(**kw), registry=Registry())


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
