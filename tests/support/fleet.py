"""Endpoints and routers for router tests: no engine behind the endpoints, marked healthy."""

from __future__ import annotations

import time

from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings


def make_pool(n: int = 4, model: str = "m") -> Pool:
    """A pool of ``n`` healthy endpoints e0..e{n-1} serving ``model``."""
    eps = []
    for i in range(n):
        ep = Endpoint(f"e{i}", f"http://127.0.0.1:{9100 + i}", model)
        ep.healthy = True
        eps.append(ep)
    return Pool(model, eps)


def scrape(ep, *, waiting=0.0, running=0.0, kv=0.0, at=None) -> None:
    """What a scrape of ``ep``'s engine would set: its gauges and when (now unless ``at``)."""
    ep.waiting, ep.running, ep.kv_usage = float(waiting), float(running), kv
    ep.scraped_at = time.monotonic() if at is None else at


def make_router(seed: int = 7, **kw) -> Router:
    """A router of ``RoutingSettings(**kw)`` drawing from a generator seeded ``seed``."""
    return Router(RoutingSettings(seed=seed, **kw), registry=Registry())
