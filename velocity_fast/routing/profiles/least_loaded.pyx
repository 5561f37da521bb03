# cython: annotation_typing=False
"""The ``least-loaded`` routing profile: the fewest requests in flight from this gateway
(least connections). It ignores prefix affinity, sessions and the engines' gauges: the
classic balancer, for uniform traffic and as a baseline."""

from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.routing.plugins cimport Profile
from velocity_fast.routing.route cimport RouteInfo, RouterPool

__all__ = ["LeastLoadedProfile"]

cdef str _LOAD = "load"


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
