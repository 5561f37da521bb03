# The router's named filters (see filters.pyx).

cimport cython

from velocity_fast.routing.plugins cimport Filter


@cython.final
cdef class Unhealthy(Filter):
    pass


@cython.final
cdef class NoRoom(Filter):
    pass


@cython.final
cdef class Excluded(Filter):
    pass


@cython.final
cdef class Saturated(Filter):
    cdef readonly double waiting
    cdef readonly double kv


@cython.final
cdef class Full(Filter):
    pass
