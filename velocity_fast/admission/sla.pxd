# The band-SLA queue model and its Retry-After promises, typed (see sla.pyx for the why).

from velocity_fast.admission.bands cimport BandQueues

cdef extern from "admission_consts.h":
    double VF_RETRY_MARGIN
    double VF_RETRY_MAX_S


cdef class PoolWork:
    cdef readonly BandQueues queues
    # The work already admitted: the expected ends of the leases held (granted, not
    # released) whose size was estimated, and the expected service of what is queued.
    cdef public double busy_end
    cdef public long busy_n
    cdef public double queued_work
    # Retry-After promises still to come due: (at, service, band, budget) in time order,
    # the service they add, and the latest time promised.
    cdef public object promises
    cdef public double promised_work
    cdef public double last_promise


cdef class SlaModel:
    # Per band: its ceiling, and its ceiling over its soft ceiling (admission's lists).
    cdef list ceilings
    cdef list soft_scales
    # How far past its SLA a prediction may go: the first band's, and the others'.
    cdef double tol_high
    cdef double tol
    cdef public object promise_counts
    cdef public object promise_metric

    cdef double slots(self, list seen, list loads, int band) except? -1.0
    cdef double backlog(self, PoolWork w, int band, double now) except? -1.0
    cdef double wait(self, PoolWork w, list seen, list loads, int band, long free, double now) except? -1.0
    cdef double held_share(self, BandQueues q, bint learned) except? -1.0
    cdef double tolerance(self, int band) noexcept
    cdef double promise(self, PoolWork w, list seen, list loads, int band, double service, double budget,
                        double now, bint* booked) except? -1.0
    cdef bint next_due(self, PoolWork w, double now, double* service, int* band, double* budget) except -1
    cdef void judged(self, bint kept) except *
