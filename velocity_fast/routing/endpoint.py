"""Endpoints (one engine each) and pools (the endpoints serving one model)."""

from __future__ import annotations

import time

__all__ = ["Endpoint", "Pool"]


class Endpoint:
    """What the gateway knows of one engine. See docs/internals.md."""

    __slots__ = ("name", "url", "model", "api_key", "healthy", "inflight", "running", "waiting",
                 "kv_usage", "scraped_at", "num_gpu_blocks", "block_size", "limit", "ejected_until",
                 "eject_backoff", "failures", "up_since", "state", "served", "errors", "upstream",
                 "max_running_seen")

    def __init__(self, name: str, url: str, model: str, *, api_key: str | None = None, limit: int = 32) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.healthy = False          # set by the first good health check
        self.inflight = 0
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.scraped_at = 0.0
        self.num_gpu_blocks: int | None = None
        self.block_size: int | None = None
        self.limit = limit
        self.max_running_seen = 0.0   # high-water mark of observed running: the learned batch capacity
        self.ejected_until = 0.0
        self.eject_backoff = 0.0
        self.failures = 0
        self.up_since = 0.0
        self.state = "unknown"        # unknown | healthy | ejected | down
        self.served = 0
        self.errors = 0
        self.upstream = None          # the UpstreamPool, set by the gateway

    def metrics_age(self, now: float | None = None) -> float:
        if not self.scraped_at:
            return float("inf")
        return (now or time.monotonic()) - self.scraped_at

    def snapshot(self) -> dict:
        return {"name": self.name, "url": self.url, "model": self.model, "state": self.state,
                "healthy": self.healthy, "inflight": self.inflight, "limit": self.limit,
                "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage,
                "metrics_age_s": round(self.metrics_age(), 3) if self.scraped_at else None,
                "num_gpu_blocks": self.num_gpu_blocks, "served": self.served, "errors": self.errors}

    def __repr__(self) -> str:
        return f"<Endpoint {self.name} {self.url} {self.model} {self.state} inflight={self.inflight}>"


class Pool:
    """The endpoints that serve one model."""

    __slots__ = ("model", "endpoints")

    def __init__(self, model: str, endpoints: list[Endpoint] | None = None) -> None:
        self.model = model
        self.endpoints: list[Endpoint] = endpoints or []

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy]
