"""Stubs for velocity_fast.routing.profiles.chat (the chat profile: sessions, prefix affinity against load)."""

import random

from velocity_fast.routing.plugins import Profile
from velocity_fast.routing.prefix import BlockHashes
from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import RoutingSettings

class ChatProfile(Profile):
    """Session affinity, then prefix affinity balanced against load, with a hot-spot guard."""
    @property
    def sessions(self) -> SessionAffinity: ...
    def __init__(self, settings: RoutingSettings, rng: random.Random, sessions: SessionAffinity) -> None: ...

DEMAND_DEPTH: int
DEMAND_TAU_S: float
DEMAND_KEYS: int

class PrefixDemand:
    """Each prefix's share of a pool's recent requests (decayed counts)."""
    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def share(self, hashes: BlockHashes) -> float:
        """Count one request of this prompt's prefix; its share of the pool's recent requests."""

def engine_queues(cands: list, stale_s: float) -> list[float]:
    """Each candidate's queue as the hot-spot guard reads it (-1: the load gap decides)."""
