# cython: annotation_typing=False
"""The ``chat`` routing profile: session affinity, then prefix affinity balanced against
load, with a hot-spot guard (docs/design.md, "Dispatch and the answer").

Once the affinity pick's engine queues ``hotspot_waiting`` requests (without fresh
gauges: carries ``hotspot_gap`` more than the least loaded), the best of the engines that
do not wins, and holds the prefix from then on too. The guard acts only for a prefix
whose demand (``PrefixDemand``) is past one engine's share of the pool. A precise pool's
requests are scored by the token side (routing/precise/); the rule is prefix.pyx's
``choose_by_affinity`` either way. A prompt without a full block goes by load, as batch.
"""

from velocity_fast.routing.prefix import choose_by_affinity
from velocity_fast.fleet.endpoint cimport Endpoint
from libc.math cimport INFINITY, exp
from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.routing.plugins cimport Profile, least_loaded
from velocity_fast.routing.prefix cimport BlockHashes
from velocity_fast.routing.route cimport RouteInfo, RouterPool

__all__ = ["ChatProfile", "PrefixDemand", "engine_queues", "DEMAND_DEPTH", "DEMAND_TAU_S", "DEMAND_KEYS"]

cdef str _LOAD = "load"
cdef str _SESSION = "session"


cdef class ChatProfile(Profile):
    """Session affinity, then prefix affinity balanced against load, with a hot-spot guard."""

    name = "chat"
    precise = True  # its prefix affinity reads the token side's scores in a precise pool

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
        key = hashes.keys[(n if n < DEMAND_DEPTH else DEMAND_DEPTH) - 1]
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
