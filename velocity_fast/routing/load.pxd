# The load scorer (see load.pyx).

from velocity_fast.routing.plugins cimport Scorer


cdef class EngineLoad(Scorer):
    pass
