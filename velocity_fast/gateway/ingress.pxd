# The gateway's front door, typed (see ingress.pyx).

from velocity_fast.admission.controller cimport Lease
from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.gateway.identity cimport Identity, Tenant
from velocity_fast.http.message cimport Request
from velocity_fast.metrics.values cimport Value
from velocity_fast.server.connection cimport Responder


cdef class Ingress:
    cdef public object app
    cdef public Identity identity
    cdef public object router
    cdef public object admission
    cdef public object monitor
    cdef public object metrics
    cdef public dict pools
    cdef public object default_model
    cdef public list band_names
    cdef public str default_band  # admission.default_band (None: "normal", else the middle band)
    cdef public long max_model_len
    cdef public object loop
    cdef public object tracing    # gateway/tracing.py's Tracing when tracing is on, else None
    cdef list grants              # the exchanges granted since their run was scheduled (exchange.pyx)
    cdef object _requests_metric
    cdef str _last_route
    cdef str _last_band
    cdef int _last_status
    cdef Value _last_count
    cdef str _last_model


# The books of an answer, called as C by the exchange too.
cdef count_request(Ingress ingress, str route, int status, str band)
cpdef settle(Ingress ingress, str route, str band, Endpoint ep, Lease lease, int status, bint engine_failed, bint ok,
             error_text, long events)
cdef internal_error(Ingress ingress, Request req, Responder resp, str rid, str route, str band, what)


cdef inline void count_reject(Tenant t, str reason):
    """One more request of ``t`` declined for ``reason`` (its figures in /stats, /metrics)."""
    d = t.rejections
    d[reason] = d.get(reason, 0) + 1
