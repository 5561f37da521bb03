# cython: annotation_typing=False
"""The ``round-robin`` routing profile: endpoints in turn, in pool order. It ignores prefix
affinity, sessions and the engines' gauges: the classic balancer, for uniform traffic
and as a baseline. Its picks count under basis ``turn``."""

from velocity_fast.fleet.endpoint cimport pool_endpoints
from velocity_fast.routing.plugins cimport Profile
from velocity_fast.routing.route cimport RouteInfo, RouterPool

__all__ = ["RoundRobinProfile"]

cdef str _TURN = "turn"


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
