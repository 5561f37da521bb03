"""The router: where a request runs. Filter -> score -> pick (docs/design.md, "Dispatch and the answer").

    router = Router(settings, registry=reg)
    info = router.route_info(model, body_obj, headers)   # profile, prefix hashes, session
    ep = router.pick(pool, info, has_room, exclude=())   # None when no endpoint qualifies
    router.on_dispatch(ep, info)                         # remember the blocks sent to ep

Filters: unhealthy endpoints, endpoints without room (``has_room(ep)`` False: at their
concurrency limit) and saturated ones (engine queue or KV usage past the thresholds).
When saturation alone would remove every endpoint, the saturated ones stay (fail open):
admission already decided that this request goes now, and refusing here would only turn
a slow answer into an error. Then the request's profile (profiles.py) scores what is
left.

Load is the engine's waiting count plus the gateway's own in-flight count. Engine
gauges older than ``metrics_stale_s`` (or never scraped) are ignored: the in-flight
count stands alone and nobody is filtered as saturated on stale evidence.

One prefix index per pool (at most 64 endpoints with affinity each); the chains are
seeded by the model name, so pools never share hashes. Pass ``route_info`` the model
of the pool the request will use (the default pool's model when the body names none).
The index only knows what this gateway sent: call ``forget(name)`` when an engine
restarted (its cache is empty) or left the configuration. ``x-session-id`` is honoured
by the chat profile (the one that favours affinity); the other profiles ignore it.
"""

from __future__ import annotations

import random
import time

from velocity_fast._core.prefix import PrefixHasher
from velocity_fast._core.router import PROFILE_HEADER, RouteInfo, RouterCore
from velocity_fast._core.router import SESSION_HEADER as SESSION_HEADER
from velocity_fast.metrics import Registry

from .profiles import make_profiles
from .session import SessionAffinity
from .settings import PROFILES, RoutingSettings

__all__ = ["Router", "RouteInfo", "UnknownProfile"]

BASES = ("prefix", "session", "load", "hotspot", "kv", "only")
# round-robin's picks are decided by the turn alone.
TURN = ("round-robin", "turn")


class UnknownProfile(ValueError):
    """The request named a routing profile that does not exist: answer 400."""

    status = 400
    type = "BadRequestError"
    param = PROFILE_HEADER

    def __init__(self, name: str) -> None:
        super().__init__(f"Unknown routing profile {name!r} in {PROFILE_HEADER}; "
                         f"expected one of: {', '.join(PROFILES)}.")
        self.profile = name


class Router(RouterCore):
    """Filter, score and pick an endpoint of a pool for a request.

    The request path (``route_info``, ``pick``, ``on_dispatch``) is compiled:
    _core/router.pyx, the ``RouterCore`` this class extends. What stays here runs once
    or per scrape: construction, ``forget``, ``hit_ratio``, ``stats``.
    """

    def __init__(self, settings: RoutingSettings | None = None, *, registry: Registry | None = None,
                 rng: random.Random | None = None) -> None:
        self.settings = s = settings or RoutingSettings()
        self._rng = rng or random.Random(s.seed)
        self._hasher = PrefixHasher(s.block_bytes)
        self._batch_infos = {}  # by model: nothing per request in them
        self._sessions = SessionAffinity()
        self._profiles = make_profiles(s, self._rng, self._sessions)
        self._pools = {}  # model -> RouterPool
        self._clock = time.monotonic
        reg = registry if registry is not None else Registry()
        self._picks = reg.counter("velocity_route_picks_total",
                                  "Endpoint picks by routing profile and what decided them.",
                                  ("profile", "basis"))
        self._pick_children = {(p, b): self._picks.labels(p, b) for p in PROFILES for b in BASES}
        self._pick_children[TURN] = self._picks.labels(*TURN)
        self._fail_open = reg.counter("velocity_route_fail_open_total",
                                      "Picks made among saturated endpoints because all were saturated.")
        self._no_endpoint = reg.counter("velocity_route_no_endpoint_total",
                                        "Picks that found no healthy endpoint with room.")
        self._blocks_sent = reg.counter("velocity_prefix_blocks_total",
                                        "Prompt blocks dispatched (prefix hashing units).")
        self._blocks_hit = reg.counter("velocity_prefix_hit_blocks_total",
                                       "Leading prompt blocks the chosen endpoint had recently been sent.")
        reg.gauge_fn("velocity_prefix_index_hit_ratio",
                     "Prefix-index hit ratio: hit blocks / dispatched blocks.", self.hit_ratio)
        reg.gauge_fn("velocity_prefix_index_blocks", "Block hashes held in the prefix index, per model.",
                     lambda: [((m, ), len(st.index)) for m, st in self._pools.items()], ("model",))
        self._configure()

    # -- lifecycle and visibility -----------------------------------------------

    def forget(self, name: str, model: str | None = None) -> None:
        """Drop what the index remembers of an endpoint (it left the configuration)."""
        for m, state in self._pools.items():
            if model is None or m == model:
                state.index.remove(name)
                state.caps.pop(name, None)

    def hit_ratio(self) -> float:
        """Dispatched prompt blocks that the chosen endpoint already held, as a fraction."""
        sent = self._blocks_sent.get()
        return self._blocks_hit.get() / sent if sent else 0.0

    def stats(self) -> dict:
        """Picks by profile and basis, filter outcomes, and the prefix index sizes."""
        picks: dict[str, dict[str, int]] = {}
        for (p, b), child in self._pick_children.items():
            if child.value:
                picks.setdefault(p, {})[b] = int(child.value)
        return {
            "picks": picks,
            "fail_open": int(self._fail_open.get()),
            "no_endpoint": int(self._no_endpoint.get()),
            "prefix_index": {
                "hit_ratio": round(self.hit_ratio(), 4),
                "blocks_sent": int(self._blocks_sent.get()),
                "blocks_hit": int(self._blocks_hit.get()),
                "block_bytes": self.settings.block_bytes,
                "pools": {m: st.index.stats() for m, st in self._pools.items()},
            },
        }
