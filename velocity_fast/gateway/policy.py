"""Where the gateway gets its admission controller and router from."""

from __future__ import annotations

import random

from ..config import Settings
from ..metrics import Registry
from ..routing.endpoint import Endpoint, Pool

__all__ = ["Ticket", "Rejected", "make_admission", "make_router"]


class Rejected(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


class Ticket:
    __slots__ = ("band", "tenant", "sla_ms", "max_tokens", "prompt_bytes", "model")

    def __init__(self, band, tenant, sla_ms, max_tokens, prompt_bytes, model) -> None:
        self.band, self.tenant, self.sla_ms = band, tenant, sla_ms
        self.max_tokens, self.prompt_bytes, self.model = max_tokens, prompt_bytes, model


class _Lease:
    __slots__ = ("ep",)

    def __init__(self) -> None:
        self.ep: Endpoint | None = None

    def bind(self, ep: Endpoint) -> None:
        if self.ep is not None:
            self.ep.inflight -= 1
        self.ep = ep
        ep.inflight += 1

    def first_byte(self) -> None:
        pass

    def release(self, outcome: str, error_text: str | None = None, tokens: int = 0) -> None:
        if self.ep is not None:
            self.ep.inflight -= 1
            self.ep = None


class _OpenAdmission:
    def __init__(self, settings: Settings, pools: dict[str, Pool], registry: Registry) -> None:
        self.pools = pools

    def start(self) -> None: ...
    async def stop(self) -> None: ...
    def add_endpoint(self, ep: Endpoint) -> None: ...
    def remove_endpoint(self, ep: Endpoint) -> None: ...
    def on_endpoint_change(self, ep: Endpoint) -> None: ...
    def on_metrics(self, ep: Endpoint) -> None: ...

    @staticmethod
    def has_room(ep: Endpoint) -> bool:
        return ep.inflight < ep.limit

    async def admit(self, ticket: Ticket) -> _Lease:
        pool = self.pools.get(ticket.model)
        if pool is None or not pool.healthy():
            raise Rejected(503, "no-endpoint", f"No healthy engine for model `{ticket.model}`.", 1.0)
        return _Lease()

    def stats(self) -> dict:
        return {}


class _LeastInflight:
    def route_info(self, model, request, headers):
        return None

    def pick(self, pool: Pool, info, has_room, exclude) -> Endpoint | None:
        best, best_load = [], None
        for ep in pool.endpoints:
            if not ep.healthy or ep in exclude:
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


def make_admission(settings: Settings, pools: dict[str, Pool], registry: Registry):
    return _OpenAdmission(settings, pools, registry)


def make_router(settings: Settings, registry: Registry):
    return _LeastInflight()
