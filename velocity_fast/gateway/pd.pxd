# Prefill/decode disaggregation, typed (see pd.pyx).

from velocity_fast.admission.controller cimport Ticket
from velocity_fast.fleet.endpoint cimport Endpoint, Pool
from velocity_fast.gateway.exchange cimport Exchange
from velocity_fast.gateway.ingress cimport Ingress
from velocity_fast.http.message cimport Request
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.server.connection cimport Responder
from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection


cdef class PdPool:
    cdef readonly list not_decode      # prefill-only endpoints: never a decode pick
    cdef readonly list not_prefill     # decode-only endpoints: never a prefill pick
    cdef readonly long min_uncached
    cdef readonly double prefill_timeout
    cdef readonly double max_in_flight  # pd.max_prefill_tokens_in_flight (0: no bound)
    cdef public long disaggregated     # requests that took two legs
    cdef public long colocated         # requests the decider ran on the decode engine alone
    cdef public long prefill_retries
    cdef public long prefill_failed    # requests answered 503 for their prefill legs
    cdef public long prefill_busy      # run on the decode engine alone: every prefill engine at its bound
    # endpoint name -> the uncached prompt tokens of the prefill legs in flight there
    cdef public dict pending


cdef class PrefillLeg(ResponseHandler):
    cdef PdExchange x
    cdef Endpoint ep
    cdef PdPool pd                     # its tokens' pool, until settled
    cdef double tokens
    cdef UpstreamConnection conn
    cdef object timer
    cdef bint over
    cdef object trace                  # its exchange's trace and the leg's span (tracing on)
    cdef object span
    cdef void _settle(self) except *
    cdef void _end_span(self, int status, err) except *
    cdef abort(self)
    cdef _finish(self, int status, body, err)


cdef class PdExchange(Exchange):
    cdef PdPool pd
    cdef int phase
    cdef PrefillLeg leg                # the prefill leg in flight
    cdef list p_tried                  # prefill engines that failed it
    cdef bytes prefill_body
    cdef Endpoint p_ep                 # the prefill engine that answered (None: colocated)
    cdef long long p_prompt
    cdef long long p_cached
    cdef double p_tokens               # the prompt's tokens the chosen prefill engine lacks
    cdef bint merged                   # a stream's usage merged
    cdef Endpoint _pick_claim(self)
    cdef _none_left(self)
    cdef _send(self, Endpoint ep)
    cdef _decide(self)
    cdef int _start_prefill(self, bint first) except -2
    cdef Endpoint _pick_prefill(self, list excl, double *least)
    cdef _prefilled(self, PrefillLeg leg, int status, body, err)
    cdef _after_prefill(self, PrefillLeg leg, int status, body, err)
    cdef _prefill_refused(self, Endpoint ep, int status, body)


cdef Exchange new_pd_exchange(Ingress ingress, Request req, Responder resp, str route, Pool pool, Ticket ticket,
                              RouteInfo info, bytes body, str rid)
