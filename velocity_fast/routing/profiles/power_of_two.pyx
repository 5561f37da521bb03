# cython: annotation_typing=False
"""The ``power-of-two`` routing profile: the power of two choices. Two of the candidates
(the endpoints the filters left: healthy, with room) are drawn at random, and the less
loaded of the two (engine waiting + gateway in flight) takes the request.

Nearly as even as the least loaded, without every gateway replica sending its next
requests to the same emptiest engine between two scrapes: the draw spreads them, and the
most loaded engine never wins. It ignores prefix affinity and sessions. One draw from the
router's generator a pick; equal loads go to the first drawn, itself at random.
"""

from libc.stdint cimport uint64_t

from velocity_fast.routing.plugins cimport Profile
from velocity_fast.routing.route cimport RouteInfo, RouterPool

__all__ = ["PowerOfTwoProfile"]

cdef str _LOAD = "load"


cdef class PowerOfTwoProfile(Profile):
    """Two candidates at random; the less loaded takes the request."""

    name = "power-of-two"

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        cdef uint64_t n = <uint64_t>len(cands), r = self.rng.getrandbits(64)
        cdef Py_ssize_t a = <Py_ssize_t>(r % n)
        cdef Py_ssize_t b = <Py_ssize_t>((r // n) % (n - 1))  # another than a: one of the n - 1 left
        if b >= a:
            b += 1
        self.basis = _LOAD
        return b if <double>loads[b] < <double>loads[a] else a
