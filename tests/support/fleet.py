"""Endpoints for router tests: no engine behind them, marked healthy."""
from __future__ import annotations

from velocity_fast.fleet.endpoint import Endpoint, Pool


def make_pool(n: int = 4, model: str = "m") -> Pool:
    """A pool of ``n`` healthy endpoints e0..e{n-1} serving ``model``."""
    eps = []
    for i in range(n):
        ep = Endpoint(f"e{i}", f"http://127.0.0.1:{9100 + i}", model)
        ep.healthy = True
        eps.append(ep)
    return Pool(model, eps)
