"""Where the gateway gets its admission controller and router from."""

from __future__ import annotations

import random

from ..admission import Admission, Rejected, Ticket
from ..config import Settings
from ..metrics import Registry
from ..routing.endpoint import Endpoint, Pool

__all__ = ["Ticket", "Rejected", "make_admission", "make_router"]


class _LeastInflight:
    def route_info(self, model, request, headers):
        return None

    def pick(self, pool: Pool, info, has_room, exclude) -> Endpoint | None:
        best, best_load = [], None
        for ep in pool.endpoints:
            if not ep.healthy or ep in exclude or not has_room(ep):
                continue
            load = ep.inflight
            if best_load is None or load < best_load:
                best, best_load = [ep], load
            elif load == best_load:
                best.append(ep)
        return random.choice(best) if best else None

    def on_dispatch(self, ep, info) -> None:
        pass

    def stats(self) -> dict:
        return {}


def make_admission(settings: Settings, pools: dict[str, Pool], registry: Registry) -> Admission:
    return Admission(settings, pools, policy=settings.policy, registry=registry)


def make_router(settings: Settings, registry: Registry):
    return _LeastInflight()
