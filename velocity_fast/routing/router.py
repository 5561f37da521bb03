"""The router: where a request runs. Filter -> score -> pick (DESIGN section 5).

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
by the chat profile (the one that favours affinity); batch and long-context ignore it.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Container, Mapping

from velocity_fast._core.prefix import BlockHashes, PrefixHasher, PrefixIndex
from velocity_fast.metrics import Registry

from .prefix_render import render_prompt
from .profiles import make_profiles
from .session import SessionAffinity
from .settings import PROFILES, RoutingSettings

__all__ = ["Router", "RouteInfo", "UnknownProfile"]

PROFILE_HEADER = "x-velocity-profile"
SESSION_HEADER = "x-session-id"
BASES = ("prefix", "session", "load", "hotspot", "kv", "only")


class UnknownProfile(ValueError):
    """The request named a routing profile that does not exist: answer 400."""

    status = 400
    type = "BadRequestError"
    param = PROFILE_HEADER

    def __init__(self, name: str) -> None:
        super().__init__(f"Unknown routing profile {name!r} in {PROFILE_HEADER}; "
                         f"expected one of: {', '.join(PROFILES)}.")
        self.profile = name


class RouteInfo:
    """What routing needs to know of one request, computed once before it waits."""

    __slots__ = ("model", "profile", "hashes", "nblocks", "session", "session_key")

    def __init__(self, model: str, profile: str, hashes: BlockHashes, session: str | None,
                 session_key: int | None) -> None:
        self.model = model
        self.profile = profile
        self.hashes = hashes
        self.nblocks = len(hashes)
        self.session = session
        self.session_key = session_key

    def __repr__(self) -> str:
        return (f"<RouteInfo model={self.model!r} profile={self.profile} blocks={self.nblocks} "
                f"session={self.session!r}>")


class _PoolState:
    """The router's memory of one pool: its prefix index and engine capacities seen."""

    __slots__ = ("pool", "index", "caps", "kv_scale", "default_capacity")

    def __init__(self, pool: Any, settings: RoutingSettings) -> None:
        self.pool = pool
        self.index = PrefixIndex(settings.index_capacity)
        self.caps: dict[str, tuple] = {}
        # Index blocks per engine token: an engine KV block of block_size tokens holds
        # block_size * kv_scale index blocks.
        self.kv_scale = settings.bytes_per_token / settings.block_bytes
        self.default_capacity = settings.index_capacity

    def kv_capacity_blocks(self, ep: Any) -> float:
        """The engine's KV cache in index blocks, or 0 when it is not known."""
        if not ep.num_gpu_blocks:
            return 0.0
        return ep.num_gpu_blocks * (ep.block_size or 16) * self.kv_scale

    def sync_capacity(self, ep: Any) -> None:
        """Bound ep's LRU by its engine's KV cache once cache_config_info has told it."""
        seen = (ep.num_gpu_blocks, ep.block_size)
        if self.caps.get(ep.name) == seen:
            return
        self.caps[ep.name] = seen
        cap = self.kv_capacity_blocks(ep)
        self.index.set_capacity(ep.name, max(1, int(cap)) if cap else self.default_capacity)

    def reclaim_slots(self) -> None:
        """Free the slots of endpoints that are no longer in the pool."""
        if self.pool is None:
            return
        present = {ep.name for ep in self.pool.endpoints}
        for name in self.index.names():
            if name not in present:
                self.index.remove(name)
                self.caps.pop(name, None)


class Router:
    """Filter, score and pick an endpoint of a pool for a request."""

    def __init__(self, settings: RoutingSettings | None = None, *, registry: Registry | None = None,
                 rng: random.Random | None = None) -> None:
        self.settings = s = settings or RoutingSettings()
        self._rng = rng or random.Random(s.seed)
        self._hasher = PrefixHasher(s.block_bytes)
        self._batch_infos: dict[str, RouteInfo] = {}  # by model: nothing per request in them
        self._sessions = SessionAffinity()
        self._profiles = make_profiles(s, self._rng, self._sessions)
        self._pools: dict[str, _PoolState] = {}
        self._clock = time.monotonic
        reg = registry if registry is not None else Registry()
        self._picks = reg.counter("velocity_route_picks_total",
                                  "Endpoint picks by routing profile and what decided them.",
                                  ("profile", "basis"))
        self._pick_children = {(p, b): self._picks.labels(p, b) for p in PROFILES for b in BASES}
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

    # -- per request -------------------------------------------------------------

    def route_info(self, model: str | None, body_obj: Any, headers: Mapping[str, str] | None) -> RouteInfo:
        """Profile, prefix block hashes and session of a request.

        body_obj is the decoded body (dict or Struct with `messages` or `prompt`), or the
        prompt bytes already rendered. Raises UnknownProfile for a bad x-velocity-profile.
        """
        model = model or ""
        s = self.settings
        profile = None
        session = None
        if headers:
            profile = headers.get(PROFILE_HEADER)
            session = headers.get(SESSION_HEADER)
        if profile:
            profile = profile.strip().lower()
            if profile not in self._profiles:
                raise UnknownProfile(profile)
        else:
            profile = s.profiles.get(model, s.default_profile)
        if session:
            session = session.strip() or None
        if profile == "batch" and not session:
            # Shortest queue needs no prefix: no rendering, no hashing, one shared RouteInfo.
            info = self._batch_infos.get(model)
            if info is None:
                info = RouteInfo(model, profile, self._hasher.hash(b"", model), None, None)
                if len(self._batch_infos) < 256:  # models come from clients: the cache stays bounded
                    self._batch_infos[model] = info
            return info
        if isinstance(body_obj, (bytes, bytearray, memoryview)):
            data = body_obj
        else:
            data = render_prompt(body_obj)
        hashes = self._hasher.hash(data, model)
        return RouteInfo(model, profile, hashes, session,
                         SessionAffinity.key(session) if session else None)

    def pick(self, pool: Any, info: RouteInfo, has_room: Callable[[Any], bool] | None = None,
             exclude: Container = ()) -> Any:
        """The endpoint of pool for this request, or None when none is healthy with room.

        exclude: endpoints not to use (those a retry already failed on)."""
        state = self._pools.get(pool.model)
        if state is None:
            state = self._pools[pool.model] = _PoolState(pool, self.settings)
        elif state.pool is not pool:
            state.pool = pool
        s = self.settings
        now = self._clock()
        stale = s.metrics_stale_s
        sat_wait = s.saturation_waiting
        sat_kv = s.saturation_kv
        cands: list = []
        loads: list[float] = []
        saturated: list = []
        saturated_loads: list[float] = []
        for ep in pool.endpoints:
            if not ep.healthy or (has_room is not None and not has_room(ep)) or (exclude and ep in exclude):
                continue
            if ep.scraped_at and now - ep.scraped_at <= stale:
                load = ep.waiting + ep.inflight
                if ep.waiting >= sat_wait or ep.kv_usage >= sat_kv:
                    saturated.append(ep)
                    saturated_loads.append(load)
                    continue
            else:
                load = float(ep.inflight)
            cands.append(ep)
            loads.append(load)
        if not cands:
            if not saturated:
                self._no_endpoint.inc()
                return None
            cands, loads = saturated, saturated_loads
            self._fail_open.inc()
        if len(cands) == 1:
            ep, basis = cands[0], "only"
        else:
            ep, basis = self._profiles[info.profile].choose(cands, loads, info, state)
        self._pick_children[(info.profile, basis)].inc()
        return ep

    def on_dispatch(self, ep: Any, info: RouteInfo) -> None:
        """Remember that info's prompt blocks were sent to ep (call once it is bound)."""
        n = info.nblocks
        if not n:
            return
        state = self._pools.get(ep.model)
        if state is None:
            state = self._pools[ep.model] = _PoolState(None, self.settings)
        index = state.index
        if index.slot_of(ep.name) < 0 and index.slot(ep.name) < 0:
            state.reclaim_slots()
        state.sync_capacity(ep)
        held = index.touch(ep.name, info.hashes)
        self._blocks_sent.inc(n)
        self._blocks_hit.inc(held)

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
