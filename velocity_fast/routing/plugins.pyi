"""Stubs for velocity_fast.routing.plugins (the steps of a pick: filter, score, pick)."""

import random
from typing import Any

from velocity_fast.fleet.endpoint import Endpoint, RoomFilter
from velocity_fast.routing.route import RouteInfo, RouterPool
from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import RoutingSettings

VERDICTS: tuple[str, str, str, str]

class Pick:
    """What the steps of one pick read besides the endpoint (the router refills one per request)."""

    now: float
    stale_s: float
    has_room: Any
    room_filter: RoomFilter | None
    exclude: Any
    def __init__(self, stale_s: float = 2.0) -> None: ...
    def fresh(self, ep: Endpoint) -> bool:
        """Whether ep's engine gauges are fresh at ``now``."""

class Filter:
    """A filter of a pick: says KEEP, FULL, SATURATED or DROP of an endpoint."""

    name: str
    def check(self, ep: Endpoint, pick: Pick) -> int:
        """KEEP, FULL, SATURATED or DROP of ep in this pick (``VERDICTS[i]`` is its name)."""

class Scorer:
    """A scorer of a pick: one number for each candidate endpoint."""

    name: str
    def score(self, ep: Endpoint, pick: Pick) -> float:
        """A number for ep in this pick (the load, in requests, for the router's)."""

class Profile:
    """A routing profile: its scoring and its pick among the candidates the filters left."""

    name: str
    needs_prefix: bool
    """False: the router hashes no prompt for it."""
    precise: bool
    """True: in a precise pool, its requests go to the token side."""
    basis: str | None
    def __init__(
        self, settings: RoutingSettings, rng: random.Random, sessions: SessionAffinity | None = None
    ) -> None: ...
    @property
    def settings(self) -> RoutingSettings: ...
    @property
    def rng(self) -> random.Random: ...
    def decide(self, cands: list, loads: list[float], info: RouteInfo, state: RouterPool) -> tuple[int, str]:
        """choose, from Python: (position in cands, basis)."""
