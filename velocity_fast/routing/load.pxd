# The load scorer (see load.pyx).

cimport cython

from velocity_fast.routing.plugins cimport Scorer


@cython.final
cdef class EngineLoad(Scorer):
    pass
