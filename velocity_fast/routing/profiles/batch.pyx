# cython: annotation_typing=False
"""The ``batch`` routing profile: the shortest queue (engine waiting + gateway in flight),
ties at random. It needs no prompt: the router hashes none for it."""

from velocity_fast.routing.plugins cimport Profile, least_loaded
from velocity_fast.routing.route cimport RouteInfo, RouterPool

__all__ = ["BatchProfile"]

cdef str _LOAD = "load"


cdef class BatchProfile(Profile):
    """The shortest queue: engine waiting + gateway in flight."""

    name = "batch"
    needs_prefix = False  # the shortest queue reads no prompt

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        self.basis = _LOAD
        return least_loaded(self.rng, loads)
