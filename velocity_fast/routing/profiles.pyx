# cython: annotation_typing=False
"""Routing profiles: how the router scores the endpoints that passed its filters.

A profile is a small policy object with one method::

    choose(cands, loads, info, state) -> (endpoint, basis)

``cands`` are the endpoints left after filtering (never empty), ``loads[i]`` the load of
``cands[i]`` (engine waiting + gateway in flight, in requests), ``info`` the request's
RouteInfo and ``state`` the router's per-pool state (prefix index, pool). ``basis`` says
what decided the pick, for the metrics: prefix, session, load, hotspot or kv.

- ``chat``: session affinity, then prefix affinity balanced against load, with a
  hot-spot guard: once the affinity pick carries more than ``hotspot_gap`` requests
  above the least loaded endpoint, load wins.
- ``batch``: the shortest queue.
- ``long-context``: the most free KV cache.
- ``round-robin``: endpoints in turn, in pool order.
- ``least-loaded``: the fewest requests in flight from this gateway (the engines'
  gauges are not read).
Ties are broken at random, so equal endpoints share the traffic.

``round-robin`` and ``least-loaded`` ignore prefix affinity and sessions: the classic
balancers, for uniform traffic and as baselines. The module is compiled; the
load-blind two read only C fields.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from velocity_fast.routing.prefix import choose_by_affinity
from velocity_fast.fleet.endpoint cimport Endpoint, pool_endpoints
from velocity_fast.routing.route cimport RouteInfo, RouterPool

from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["Profile", "ChatProfile", "BatchProfile", "LongContextProfile", "RoundRobinProfile",
           "LeastLoadedProfile", "make_profiles"]

# Scores closer than this are a tie (float noise must not defeat the random tie-break).
_EPS = 1e-9
# Free KV fractions closer than this count as equal for long-context (then the shorter
# queue wins): scraped usage is not more precise than that.
_KV_TIE = 1e-3


def _pick_max(rng: random.Random, scores: Sequence[float], among: Sequence[int] | None = None) -> int:
    """Index of the highest score (restricted to `among` when given), ties at random."""
    idx = range(len(scores)) if among is None else among
    top = max(scores[i] for i in idx)
    ties = [i for i in idx if scores[i] >= top - _EPS]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


def _least_loaded(rng: random.Random, loads: Sequence[float]) -> int:
    low = min(loads)
    ties = [i for i, x in enumerate(loads) if x <= low + _EPS]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


class Profile:
    """Base of the profiles: holds the settings and the tie-breaking generator."""

    name = ""
    __slots__ = ("settings", "rng")

    def __init__(self, settings: RoutingSettings, rng: random.Random) -> None:
        self.settings = settings
        self.rng = rng

    def choose(self, cands: list, loads: list[float], info: Any, state: Any) -> tuple[Any, str]:
        raise NotImplementedError


class BatchProfile(Profile):
    """The shortest queue: engine waiting + gateway in flight."""

    name = "batch"
    __slots__ = ()

    def choose(self, cands, loads, info, state):
        return cands[_least_loaded(self.rng, loads)], "load"


class LongContextProfile(Profile):
    """The most free KV cache.

    Scraped KV usage lags by a scrape interval, so requests sent since (gateway in
    flight beyond what the engine reports as running or waiting) are counted as taking
    this request's blocks each; otherwise a burst would all land on the endpoint that
    looked emptiest at the last scrape. Equal free KV (within _KV_TIE) goes to the
    shorter queue.
    """

    name = "long-context"
    __slots__ = ()

    def choose(self, cands, loads, info, state):
        blocks = info.nblocks
        free = []
        for ep in cands:
            f = 1.0 - ep.kv_usage
            unseen = ep.inflight - ep.running - ep.waiting
            if unseen > 0 and blocks:
                cap = state.kv_capacity_blocks(ep)
                if cap:
                    f -= unseen * blocks / cap
            free.append(f)
        top = max(free)
        near = [i for i, f in enumerate(free) if f >= top - _KV_TIE]
        if len(near) > 1:
            return cands[_pick_max(self.rng, [-x for x in loads], near)], "kv"
        return cands[near[0]], "kv"


class ChatProfile(Profile):
    """Session affinity, then prefix affinity balanced against load, with a hot-spot guard."""

    name = "chat"
    __slots__ = ("sessions",)

    def __init__(self, settings: RoutingSettings, rng: random.Random, sessions: SessionAffinity) -> None:
        super().__init__(settings, rng)
        self.sessions = sessions

    def choose(self, cands, loads, info, state):
        s = self.settings
        if info.session_key is not None:
            min_load = min(loads)
            owner = self.sessions.owner(info.session_key, state.pool.endpoints)
            if owner is not None:
                for i, ep in enumerate(cands):
                    if ep is owner:
                        if loads[i] - min_load <= s.session_gap:
                            return ep, "session"
                        break
            # The owner is filtered out or too hot: this request goes by prefix and
            # load; the session stays mapped to its owner for the next one.
        pr = (<RouteInfo?>info).precise  # a C field read: the approximate path pays a pointer test
        if pr is not None:  # a precise pool: the engines' own KV events where they can be trusted
            i, basis = pr.owner.choose(pr, cands, loads, info, state, self.rng.getrandbits(64))
            return cands[i], basis
        i, basis = choose_by_affinity(state.index, info.hashes, cands, loads, s.hotspot_gap,
                                      s.load_weight, self.rng.getrandbits(64))
        return cands[i], basis


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
# Profiles are dispatched by name in ``_pick`` (``choose`` of the request's profile,
# after the filters), so adding these two leaves the path of chat, batch and
# long-context as it was. They ignore prefix affinity, sessions and the engines'
# gauges: the classic balancers, for uniform traffic and as baselines.

cdef str _TURN = "turn"
cdef str _LOAD = "load"


cdef class RoundRobinProfile:
    """Endpoints in turn, in pool order: each pick takes the first candidate at or after
    the pool position following the last pick (wrapping around), so the endpoints the
    filters leave share the traffic evenly whatever the load."""

    name = "round-robin"

    def __init__(self, settings, rng):
        self.settings = settings
        self.rng = rng

    def choose(self, list cands not None, list loads, RouteInfo info, RouterPool state not None):
        cdef list eps = pool_endpoints(state.pool) if state.pool is not None else cands
        cdef Py_ssize_t n = len(eps), j = 0, turn = state.turn, first_pos = -1
        first = None
        # cands are in pool order (the filters keep it): one walk finds their positions.
        for c in cands:
            while j < n and eps[j] is not c:
                j += 1
            if j == n:
                break
            if first_pos < 0:
                first_pos, first = j, c
            if j >= turn:
                state.turn = j + 1
                return c, _TURN
        if first is None:  # candidates not found in the pool's order: take them in turn
            first_pos = turn % len(cands)
            first = cands[first_pos]
        state.turn = first_pos + 1
        return first, _TURN


cdef class LeastLoadedProfile:
    """The fewest requests in flight from this gateway (least connections); the engines'
    gauges are not read. Ties are broken at random."""

    name = "least-loaded"

    def __init__(self, settings, rng):
        self.settings = settings
        self.rng = rng

    def choose(self, list cands not None, list loads, RouteInfo info, RouterPool state):
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
        return cands[best], _LOAD
