# cython: annotation_typing=False
"""Routing profiles: how the router scores the endpoints that passed its filters.

A profile is a ``Profile`` (plugins.pyx) with one C method::

    choose(cands, loads, info, state) -> position in cands; sets basis

``cands`` are the endpoints left after filtering (two or more), ``loads[i]`` the load of
``cands[i]`` (engine waiting + gateway in flight, in requests), ``info`` the request's
RouteInfo and ``state`` the router's per-pool state (prefix index, pool). ``basis`` says
what decided the pick, for the metrics: prefix, session, load, hotspot, kv or turn.

- ``chat``: session affinity, then prefix affinity balanced against load, with a
  hot-spot guard: once the affinity pick's engine queues ``hotspot_waiting`` requests
  (without fresh gauges: carries ``hotspot_gap`` more than the least loaded), the best
  of the engines that do not wins, and holds the prefix from then on too.
- ``batch``: the shortest queue.
- ``long-context``: the most free KV cache.
- ``round-robin``: endpoints in turn, in pool order.
- ``least-loaded``: the fewest requests in flight from this gateway (the engines'
  gauges are not read).
Ties are broken at random, so equal endpoints share the traffic.

``round-robin`` and ``least-loaded`` ignore prefix affinity and sessions: the classic
balancers, for uniform traffic and as baselines. The router calls ``choose`` as C.
"""

from __future__ import annotations

import random
from typing import Any

from velocity_fast.routing.prefix import choose_by_affinity
from velocity_fast.fleet.endpoint cimport Endpoint, pool_endpoints
from libc.math cimport INFINITY, exp
from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.routing.prefix cimport BlockHashes
from velocity_fast.routing.route cimport RouteInfo, RouterPool
from velocity_fast.routing.plugins cimport Profile, least_loaded

from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["ChatProfile", "BatchProfile", "LongContextProfile", "RoundRobinProfile",
           "LeastLoadedProfile", "PrefixDemand", "engine_queues", "make_profiles"]

# Free KV fractions closer than this count as equal for long-context (then the shorter
# queue wins): scraped usage is not more precise than that.
cdef double _KV_TIE = 1e-3

cdef str _LOAD = "load"
cdef str _KV = "kv"
cdef str _SESSION = "session"
cdef str _TURN = "turn"


cdef class BatchProfile(Profile):
    """The shortest queue: engine waiting + gateway in flight."""

    name = "batch"

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        self.basis = _LOAD
        return least_loaded(self.rng, loads)


cdef class LongContextProfile(Profile):
    """The most free KV cache.

    Scraped KV usage lags by a scrape interval, so requests sent since (gateway in
    flight beyond what the engine reports as running or waiting) are counted as taking
    this request's blocks each; otherwise a burst would all land on the endpoint that
    looked emptiest at the last scrape. Equal free KV (within _KV_TIE) goes to the
    shorter queue.
    """

    name = "long-context"

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        cdef Py_ssize_t blocks = info.nblocks, i, n = len(cands)
        cdef double f, unseen, cap, top = 0.0
        cdef Endpoint ep
        cdef list free = []
        cdef list near
        for i in range(n):
            ep = <Endpoint?>cands[i]
            f = 1.0 - ep.kv_usage
            unseen = <double>ep.inflight - ep.running - ep.waiting
            if unseen > 0 and blocks:
                cap = state.kv_capacity_blocks(ep)
                if cap:
                    f -= unseen * blocks / cap
            free.append(f)
            if i == 0 or f > top:
                top = f
        near = [i for i in range(n) if <double>free[i] >= top - _KV_TIE]
        self.basis = _KV
        if len(near) > 1:
            return least_loaded(self.rng, loads, near)
        return <Py_ssize_t>near[0]


cdef class ChatProfile(Profile):
    """Session affinity, then prefix affinity balanced against load, with a hot-spot guard."""

    name = "chat"

    def __init__(self, settings, rng, sessions):
        Profile.__init__(self, settings, rng)
        self.sessions = sessions

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        cdef Py_ssize_t i
        s = self.settings
        if info.session_key is not None:
            min_load = min(loads)
            owner = self.sessions.owner(info.session_key, state.pool.endpoints)
            if owner is not None:
                for i in range(len(cands)):
                    if cands[i] is owner:
                        if loads[i] - min_load <= s.session_gap:
                            self.basis = _SESSION
                            return i
                        break
            # The owner is filtered out or too hot: this request goes by prefix and
            # load; the session stays mapped to its owner for the next one.
        if info.nblocks == 0:
            # No full block: no prefix to route by, and no demand of its own (every such
            # prompt would count as one hot prefix): the shortest queue, as batch.
            self.basis = _LOAD
            return least_loaded(self.rng, loads)
        # The hot-spot guard is for a prefix whose demand is past one engine's share of the
        # pool: a prefix within it stays where its cache is, however busy that engine.
        demand = state.demand
        if demand is None:
            demand = state.demand = PrefixDemand()
        hw = s.hotspot_waiting
        waits = None
        if (<PrefixDemand>demand).share(info.hashes) * len(cands) <= 1.0:
            hw = INFINITY  # the guard off
        elif hw > 0:
            waits = engine_queues(cands, s.metrics_stale_s)
        pr = info.precise  # a C field read: the approximate path pays a pointer test
        if pr is not None:  # a precise pool: the engines' own KV events where they can be trusted
            i, self.basis = pr.owner.choose(pr, cands, loads, info, state, self.rng.getrandbits(64), waits, hw)
            return i
        i, self.basis = choose_by_affinity(state.index, info.hashes, cands, loads, s.hotspot_gap,
                                           s.load_weight, self.rng.getrandbits(64), waits, hw)
        return i


# A prompt's prefix, for its demand: the chain hash at this many blocks (1 KiB: a system
# prompt, a shared document's head), or at its last block when shorter.
DEMAND_DEPTH = 16
# Demand is counted with this time constant (seconds): a rate over the last few seconds.
DEMAND_TAU_S = 10.0
# Prefixes tracked per pool; past it, the ones with the least demand are dropped.
DEMAND_KEYS = 4096


cdef class PrefixDemand:
    """Each prefix's share of a pool's recent requests, as exponentially decayed counts
    (time constant DEMAND_TAU_S), keyed by the chain hash at DEMAND_DEPTH blocks."""

    cdef dict _keys   # key -> [count, at]
    cdef double _total, _at

    def __init__(self):
        self._keys = {}
        self._total = 0.0
        self._at = 0.0

    def __len__(self):
        return len(self._keys)

    cpdef double share(self, BlockHashes hashes) except -1.0:
        """Count one request of this prompt's prefix and return the prefix's share of the
        pool's recent requests (0 for a prompt without a full block)."""
        cdef Py_ssize_t n = hashes.n
        cdef double now = monotonic(), c
        cdef list entry
        if n == 0:
            return 0.0
        key = hashes._h[(n if n < DEMAND_DEPTH else DEMAND_DEPTH) - 1]
        self._total = self._total * exp(-(now - self._at) / DEMAND_TAU_S) + 1.0
        self._at = now
        entry = self._keys.get(key)
        if entry is None:
            if len(self._keys) >= DEMAND_KEYS:
                self._prune(now)
            self._keys[key] = [1.0, now]
            return 1.0 / self._total
        c = <double>entry[0] * exp(-(now - <double>entry[1]) / DEMAND_TAU_S) + 1.0
        entry[0] = c
        entry[1] = now
        return c / self._total

    cdef void _prune(self, double now) except *:
        """Drop the prefixes whose decayed count is below the median's."""
        cdef list counts = sorted(<double>v[0] * exp(-(now - <double>v[1]) / DEMAND_TAU_S)
                                  for v in self._keys.values())
        cdef double cut = counts[len(counts) // 2]
        for k in [k for k, v in self._keys.items()
                  if <double>v[0] * exp(-(now - <double>v[1]) / DEMAND_TAU_S) <= cut]:
            del self._keys[k]


cpdef list engine_queues(list cands, double stale_s):
    """Each candidate engine's queue as the hot-spot guard reads it (choose_by_affinity's
    ``waits``): where its gauges are at most ``stale_s`` old, the larger of its waiting
    gauge and what this gateway has in flight there beyond the batch admission learned
    for it (``running_cap``: the gauge lags by a scrape, this count does not); -1
    without fresh gauges (the load gap decides then).
    A long batch of running requests is no queue: it is what prefix caching is for."""
    cdef double now = monotonic()
    cdef double q, sent
    cdef Endpoint ep
    cdef list out = []
    for c in cands:
        q = -1.0
        if isinstance(c, Endpoint):
            ep = <Endpoint>c
            if ep.scraped_at and now - ep.scraped_at <= stale_s:
                q = ep.waiting
                if ep.running_cap > 0:
                    sent = <double>ep.inflight - ep.running_cap
                    if sent > q:
                        q = sent
        out.append(q)
    return out


def make_profiles(settings: RoutingSettings, rng: random.Random, sessions: SessionAffinity) -> dict[str, Any]:
    """The profiles by name."""
    return {
        "chat": ChatProfile(settings, rng, sessions),
        "batch": BatchProfile(settings, rng),
        "long-context": LongContextProfile(settings, rng),
        "round-robin": RoundRobinProfile(settings, rng),
        "least-loaded": LeastLoadedProfile(settings, rng),
    }


# -- the load-blind profiles -------------------------------------------------------
#
# They ignore prefix affinity, sessions and the engines' gauges: the classic balancers,
# for uniform traffic and as baselines.

cdef class RoundRobinProfile(Profile):
    """Endpoints in turn, in pool order: each pick takes the first candidate at or after
    the pool position following the last pick (wrapping around), so the endpoints the
    filters leave share the traffic evenly whatever the load."""

    name = "round-robin"

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        cdef list eps = pool_endpoints(state.pool) if state.pool is not None else cands
        cdef Py_ssize_t n = len(eps), j = 0, turn = state.turn, first_pos = -1, ci
        self.basis = _TURN
        # cands are in pool order (the filters keep it): one walk finds their positions.
        for ci in range(len(cands)):
            c = cands[ci]
            while j < n and eps[j] is not c:
                j += 1
            if j == n:
                break
            if first_pos < 0:
                first_pos = j
            if j >= turn:
                state.turn = j + 1
                return ci
        if first_pos < 0:  # candidates not found in the pool's order: take them in turn
            first_pos = turn % len(cands)
            state.turn = first_pos + 1
            return first_pos
        state.turn = first_pos + 1  # past the last: around to the first candidate
        return 0


cdef class LeastLoadedProfile(Profile):
    """The fewest requests in flight from this gateway (least connections); the engines'
    gauges are not read. Ties are broken at random."""

    name = "least-loaded"

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        cdef Endpoint ep
        cdef long low = 0, ties = 0, k
        cdef Py_ssize_t i, n = len(cands), best = 0
        for i in range(n):
            ep = <Endpoint?>cands[i]
            if i == 0 or ep.inflight < low:
                low, best, ties = ep.inflight, i, 1
            elif ep.inflight == low:
                ties += 1
        if ties > 1:  # the k-th of the tied ones, k at random
            k = self.rng.randrange(ties)
            for i in range(n):
                if (<Endpoint>cands[i]).inflight == low:
                    if k == 0:
                        best = i
                        break
                    k -= 1
        self.basis = _LOAD
        return best
