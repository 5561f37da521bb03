# Routing's per-request and per-pool records, typed (see route.pyx).

from velocity_fast.routing.prefix cimport BlockHashes, PrefixIndex


cdef class RouteInfo:
    cdef readonly object model
    cdef readonly object profile
    cdef readonly BlockHashes hashes
    cdef readonly Py_ssize_t nblocks
    cdef readonly object session
    cdef readonly object session_key
    cdef public object precise  # a precise pool's token-side request (routing/precise/), else None


cdef class RouterPool:
    cdef public object pool
    cdef readonly PrefixIndex index
    cdef readonly dict caps
    cdef readonly double kv_scale
    cdef readonly object default_capacity
    cdef public Py_ssize_t turn  # round-robin: the pool position served next
    cdef public object demand    # chat: the pool's PrefixDemand (routing/profiles/chat.pyx), made on first use

    cpdef double kv_capacity_blocks(self, ep) except? -1.0
    cpdef sync_capacity(self, ep)
    cpdef reclaim_slots(self)
