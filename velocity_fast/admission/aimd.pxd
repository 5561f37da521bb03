# State and signatures of the AIMD concurrency limit (see aimd.pyx for the why).

cdef extern from "admission_consts.h":
    double VF_AIMD_INCREASE
    double VF_AIMD_DECREASE
    double VF_AIMD_COOLDOWN_S


cdef class AimdLimit:
    cdef readonly int minimum
    cdef readonly int maximum
    cdef readonly int initial
    cdef readonly double value
    cdef readonly double cooldown
    cdef readonly double frozen_until
    cdef readonly double last_decrease
    cdef readonly long increases
    cdef readonly long decreases
    cdef readonly long ooms
    # Slow start is on: no decrease since the start, or since the engine was last idle.
    cdef readonly bint slow

    cpdef bint frozen(self, double now)
    cpdef bint on_sample(self, bint queued, bint at_limit, bint healthy, double now)
    cpdef bint on_probe(self, double now)
    cpdef bint on_breach(self, double started_at, double now)
    cpdef void on_oom(self, double now)
    cpdef bint on_idle(self, double now)
