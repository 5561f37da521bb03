# The compiled profiles (see profiles.pyx).

cdef class RoundRobinProfile:
    cdef readonly object settings
    cdef readonly object rng


cdef class LeastLoadedProfile:
    cdef readonly object settings
    cdef readonly object rng
