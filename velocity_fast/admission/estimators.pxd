# The estimators, typed (see estimators.pyx).


cdef class Ewma:
    cdef readonly double alpha
    cdef double _value
    cdef readonly bint seen
    cdef readonly long samples

    cdef void add(self, double x)


cdef class ServiceEstimate:
    cdef readonly Ewma ttft
    cdef readonly Ewma tpot
    cdef readonly Ewma service

    cdef void first_byte(self, double ttft_s)
    cdef void done(self, double ttft_s, double service_s, long tokens)
    cdef double expect(self, long max_tokens)
