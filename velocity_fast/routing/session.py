"""Session affinity: `x-session-id` to an endpoint by rendezvous hashing.

Each endpoint scores every session with a hash of (session, endpoint name); the session
belongs to the healthy endpoint with the highest score. When an endpoint leaves, only
its own sessions move (each to its next-highest endpoint), and when one joins it takes
only the sessions it now wins -- no global reshuffle, no shared table, and every
gateway replica computes the same owner without talking to the others.
"""

from __future__ import annotations

from typing import Iterable

from velocity_fast.routing.prefix import hash_bytes, rendezvous_weight

__all__ = ["SessionAffinity"]

# Distinct seeds keep session keys and endpoint keys in different hash spaces.
_SESSION_SEED = 0x5E551011
_NODE_SEED = 0xE11D9017
# Endpoint names are few and come from config; the cap only guards against churn.
_NAME_CACHE_MAX = 4096


class SessionAffinity:
    """Rendezvous hashing of session ids over endpoints (anything with a ``name``)."""

    __slots__ = ("_names",)

    def __init__(self) -> None:
        self._names: dict[str, int] = {}

    @staticmethod
    def key(session_id: str) -> int:
        """The 64-bit key of a session id (stable across processes)."""
        return hash_bytes(session_id, _SESSION_SEED)

    def _node(self, name: str) -> int:
        h = self._names.get(name)
        if h is None:
            if len(self._names) >= _NAME_CACHE_MAX:
                self._names.clear()
            h = self._names[name] = hash_bytes(name, _NODE_SEED)
        return h

    def owner(self, key: int, endpoints: Iterable):
        """The healthy endpoint that owns the session key, or None when none is healthy."""
        best = None
        best_w = -1
        for ep in endpoints:
            if not ep.healthy:
                continue
            w = rendezvous_weight(key, self._node(ep.name))
            if w > best_w:
                best, best_w = ep, w
        return best
