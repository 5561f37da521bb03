# cython: annotation_typing=False
"""The ``long-context`` routing profile: the most free KV cache, then the shorter queue."""

from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.routing.plugins cimport Profile, least_loaded
from velocity_fast.routing.route cimport RouteInfo, RouterPool

__all__ = ["LongContextProfile"]

# Free KV fractions closer than this count as equal (then the shorter queue wins):
# scraped usage is not more precise than that.
cdef double _KV_TIE = 1e-3
cdef str _KV = "kv"


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
