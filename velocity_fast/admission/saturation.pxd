# State and signatures of the saturation model (see saturation.pyx for the why).

from velocity_fast.fleet.endpoint cimport Endpoint

cdef extern from "admission_consts.h":
    double VF_QUEUE_THRESHOLD
    double VF_KV_THRESHOLD
    double VF_KV_PROJECTED
    double VF_KV_HELD
    double VF_STALE_AFTER_S


# How many scrapes' readings of other gateways' work ``others`` is the most of.
cdef enum:
    OTHERS_SCRAPES = 3


cdef class EndpointLoad:
    # Last scrape of the engine (zero until the first one).
    cdef readonly double running
    cdef readonly double waiting
    cdef readonly double kv
    cdef readonly double scraped_at
    # Learned batch capacity: high-water mark of observed running.
    cdef readonly double capacity
    # True once two scrapes in a row showed a queue that a step in between did not take in,
    # i.e. running was at the engine's ceiling.
    cdef readonly bint capacity_known
    # The previous scrape showed a queue beside running requests.
    cdef readonly bint queue_seen
    # What the engine ran beyond this gateway's own requests: other replicas' work, the
    # most of the last OTHERS_SCRAPES scrapes' readings (observe_endpoint), each in ``seen``.
    cdef readonly double others
    cdef double seen[OTHERS_SCRAPES]
    cdef int seen_at
    # The decode this gateway's requests bound here have left, as sums (admission keeps
    # them at bind and release): how many, their max_tokens, their bind times; with the
    # engine's pace (s a token, 0 unknown) and its KV cache in tokens (0 unknown).
    cdef public double bound_n
    cdef public double bound_tokens
    cdef public double bound_t
    cdef public double pace
    cdef public double kv_tokens
    # The share of their max_tokens requests here decoded before they ended (a moving
    # average; 1 until one ended with its count known): what kv_ahead expects of each.
    cdef public double out_share
    # Each bound request's bind time and max_tokens (bind_work), for kv_peak.
    # Batch work is bound here one request at a time, at the pace the cache takes it
    # (batch_interval): not before this time again. What a request holds of the cache
    # besides its decoded tokens, learned from scrapes (learn_fixed).
    cdef public double batch_next
    cdef public double kv_fixed
    cdef double* _b_at
    cdef double* _b_tok
    cdef int _b_n
    cdef int _b_cap
    # The gateway's own view, kept by admission.
    cdef public long inflight
    cdef public long limit
    cdef public bint healthy
    cdef readonly double value

    cpdef void observe(self, double running, double waiting, double kv, double scraped_at, double decoded=*)
    cpdef void bind_work(self, double max_tokens, double at, double sign) noexcept
    cdef void ended(self, double tokens, double max_tokens) noexcept
    cpdef double kv_ahead(self, double now) noexcept
    cpdef double kv_peak(self, double extra_n=*, double extra_tokens=*) noexcept
    cdef bint held_by_cache(self, double now) noexcept
    cdef void learn_fixed(self, double block) noexcept
    cdef double batch_interval(self, double max_tokens, double cap) noexcept


cdef void sync_shared(Endpoint ep, EndpointLoad load) noexcept
cpdef void observe_endpoint(EndpointLoad load, Endpoint ep)
cpdef bint refresh(list loads, list eps) except -1
cpdef long free_slots(list eps, long pending) except? -1


cdef class Saturation:
    cdef readonly double queue_threshold
    cdef readonly double kv_threshold
    cdef readonly double stale_after

    cpdef double endpoint(self, EndpointLoad load, double now, double extra=*, double soft_scale=*,
                          double extra_tokens=*, double peak_cap=*)
    cpdef double update(self, EndpointLoad load, double running, double waiting,
                        double kv, double scraped_at, double now)
    cpdef double pool(self, list loads, double pending, double now, double soft_scale=*, double pending_tokens=*,
                      double peak_cap=*)
