# Admission's telemetry, typed (see telemetry.pyx).

cimport cython

from velocity_fast.metrics.values cimport HistChild, Value

# A lease's outcomes as ints on the request path (telemetry.OUTCOMES[i] is the name).
cdef enum:
    COMPLETED = 0
    FAILED = 1
    CANCELLED = 2


cdef inline int outcome_code(str outcome) except -1:
    if outcome == "completed":
        return COMPLETED
    if outcome == "failed":
        return FAILED
    if outcome == "cancelled":
        return CANCELLED
    raise ValueError(f"outcome must be one of ('completed', 'failed', 'cancelled'), not {outcome!r}")


cdef class Window:
    cdef double* _data
    cdef Py_ssize_t _maxlen
    cdef Py_ssize_t _next
    cdef Py_ssize_t _n

    cdef void push(self, double x) noexcept


@cython.final
cdef class Telemetry:
    cdef readonly object registry
    cdef readonly object admitted
    cdef readonly object completed
    cdef readonly object failed
    cdef readonly object cancelled
    cdef readonly object rejections
    cdef readonly object queue_wait
    cdef readonly object ttft
    cdef readonly object latency
    cdef Value _admitted
    cdef Value _completed
    cdef Value _failed
    cdef Value _cancelled
    cdef object _ttft
    cdef list _wait_children
    cdef list _lat_children
    cdef public long n_admitted
    cdef public long n_completed
    cdef public long n_failed
    cdef public long n_cancelled
    cdef public dict reasons
    cdef public long queue_cancelled
    cdef public long sla_met
    cdef public long sla_missed
    cdef readonly list waits
    cdef readonly Window e2e
    cdef readonly Window ttfts

    cpdef reject(self, str reason)
    cpdef void granted(self, int band, double wait_s) except *
    cpdef void finished(self, int band, int outcome, double e2e_s, double ttft_s, int sla) except *
