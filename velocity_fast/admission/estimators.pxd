# The estimators, typed (see estimators.pyx).

cimport cython


cdef class Ewma:
    cdef readonly double alpha
    cdef double _value
    cdef readonly bint seen
    cdef readonly long samples

    cdef void _observe(self, double x)


@cython.final
cdef class ServiceEstimate:
    cdef readonly Ewma ttft
    cdef readonly Ewma tpot
    cdef readonly Ewma service
    cdef double keep              # 1 - alpha: the weight an older stream keeps in the line
    # The first-token line's weighted sums (prompt bytes x, first token y), streams only.
    cdef double w
    cdef double sx
    cdef double sy
    cdef double sxx
    cdef double sxy
    cdef readonly long streams

    cpdef void observe_first_byte(self, double ttft_s)
    cdef double first_token(self, double nbytes)
    cpdef void observe(self, double ttft_s, double service_s, long tokens, double nbytes=*)
    cdef double expect_size(self, double nbytes, long max_tokens)
    cdef double expect(self, long max_tokens)


# The answers an OutputEstimate averages (the last ones).
cdef enum:
    OPEN_RING = 64


@cython.final
cdef class OutputEstimate:
    cdef readonly double start
    cdef readonly double mean
    cdef readonly long answers
    cdef long ring[OPEN_RING]     # the last answers' completion tokens, oldest overwritten
    cdef long total               # their sum

    cpdef long expect(self)
    cpdef void observe(self, long tokens)
