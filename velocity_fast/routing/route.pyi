"""Stubs for velocity_fast.routing.route (what routing knows of one request and of one pool)."""

from typing import Any

from velocity_fast.routing.prefix import BlockHashes, PrefixIndex

class RouteInfo:
    """What routing needs to know of one request, computed once before it waits."""
    def __init__(
        self, model: str, profile: str, hashes: BlockHashes, session: str | None, session_key: int | None
    ) -> None: ...
    @property
    def model(self) -> str: ...
    @property
    def profile(self) -> str: ...
    @property
    def hashes(self) -> BlockHashes: ...
    @property
    def nblocks(self) -> int: ...
    @property
    def session(self) -> str | None: ...
    @property
    def session_key(self) -> int | None: ...
    precise: Any

class RouterPool:
    """The router's memory of one pool: its prefix index and engine capacities seen."""

    pool: Any
    turn: int
    demand: Any  # the chat profile's PrefixDemand of this pool (None until its first pick)
    def __init__(self, pool: Any, settings: Any) -> None: ...
    @property
    def index(self) -> PrefixIndex: ...
    @property
    def caps(self) -> dict[str, tuple]: ...
    @property
    def kv_scale(self) -> float: ...
    @property
    def default_capacity(self) -> int: ...
    def kv_capacity_blocks(self, ep: Any) -> float:
        """The engine's KV cache in index blocks, or 0 when it is not known."""
    def sync_capacity(self, ep: Any) -> None:
        """Bound ep's LRU by its engine's KV cache once cache_config_info has told it."""
    def reclaim_slots(self) -> None:
        """Free the slots of endpoints that are no longer in the pool."""
