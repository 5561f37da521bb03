"""Stubs for velocity_fast.fleet.endpoint (endpoints and pools)."""

from typing import Any

STATS_WHOLE: frozenset[str]

class Endpoint:
    """What the gateway knows of one engine. See docs/internals.md."""

    name: str
    url: str
    model: str
    api_key: str | None
    healthy: bool
    inflight: int
    running: float
    waiting: float
    kv_usage: float
    scraped_at: float
    num_gpu_blocks: int | None
    block_size: int | None
    max_model_len: int | None
    limit: int
    max_running_seen: float
    running_cap: float
    pace: float
    pace_batch: float
    decoded: float
    inflight_peak: int
    others: float
    ejected_until: float
    eject_backoff: float
    failures: int
    up_since: float
    state: str
    served: int
    errors: int
    upstream: Any
    role: str
    def __init__(
        self, name: str, url: str, model: str, *, api_key: str | None = None, limit: int = 32, role: str = "both"
    ) -> None: ...
    def metrics_age(self, now: float | None = None) -> float: ...
    def snapshot(self) -> dict: ...

class Pool:
    """The endpoints that serve one model."""

    model: str
    endpoints: list[Endpoint]
    pd: Any
    def __init__(self, model: str, endpoints: list[Endpoint] | None = None) -> None: ...
    def healthy(self) -> list[Endpoint]: ...
    def context_length(self, cap: int) -> int: ...

class RoomFilter:
    """A router's filter of endpoints asked as C (an admission lease is one)."""
    def has_room(self, ep: Endpoint) -> bool:
        """Room on ``ep`` for the request (this base: everywhere)."""
    def __call__(self, ep: Endpoint) -> bool: ...
