"""Stubs for velocity_fast.routing.router (the router: filter, score, pick)."""

import random
from collections.abc import Callable, Container, Mapping
from typing import Any

from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.prefix import BlockDigests
from velocity_fast.routing.route import RouteInfo
from velocity_fast.routing.settings import RoutingSettings

BASES: tuple[str, ...]
TURN: tuple[str, str]

class Router:
    """Filter, score and pick an endpoint of a pool for a request."""

    settings: RoutingSettings
    _clock: Callable[[], float]
    _precise: Any
    def __init__(
        self,
        settings: RoutingSettings | None = None,
        *,
        registry: Registry | None = None,
        rng: random.Random | None = None,
        precise: Any = None,
    ) -> None: ...
    def forget(self, name: str, model: str | None = None) -> None:
        """Drop what the index remembers of an endpoint (it left the configuration)."""
    def hit_ratio(self) -> float:
        """Dispatched prompt blocks that the chosen endpoint already held, as a fraction."""
    def stats(self) -> dict:
        """Picks by profile and basis, filter outcomes, and the prefix index sizes."""
    def route_info(
        self,
        model: str | None,
        body_obj: Any,
        headers: Mapping[str, str] | None,
        compact: bool = False,
        digests: BlockDigests | None = None,
    ) -> RouteInfo:
        """Profile, prefix block hashes and session of a request (UnknownProfile for a bad header)."""
    def pick(
        self, pool: Any, info: RouteInfo, has_room: Callable[[Any], bool] | None = None, exclude: Container = ()
    ) -> Any:
        """The endpoint of pool for this request, or None when none is healthy with room."""
    def matched_blocks(self, ep: Any, info: RouteInfo) -> int:
        """How many of info's leading prompt blocks the prefix index says ep was sent recently."""
    def kv_blocks_held(self, ep: Any, info: RouteInfo) -> tuple[int, int] | None:
        """(prompt token blocks, how many ep's engine holds by its KV events, -1: not exact), or None."""
    def on_dispatch(self, ep: Any, info: RouteInfo) -> None:
        """Remember that info's prompt blocks were sent to ep (call once it is bound)."""
    def profile(self, name: str) -> Any:
        """The profile called name (its basis: what decided its last choice), or None."""
    def cached_room(self, pool: Any, info: RouteInfo) -> float:
        """The largest fraction of info's prompt an endpoint of pool with room holds."""
    def cached_on(self, pool: Any, info: RouteInfo, ep: Any) -> float:
        """The fraction of info's prompt blocks ep was sent recently."""
