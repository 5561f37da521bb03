# The router's named filters (see filters.pyx).

from velocity_fast.routing.plugins cimport Filter


cdef class Unhealthy(Filter):
    pass


cdef class NoRoom(Filter):
    pass


cdef class Excluded(Filter):
    pass


cdef class Saturated(Filter):
    cdef readonly double waiting
    cdef readonly double kv


cdef class Full(Filter):
    pass
