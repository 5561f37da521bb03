# One proxied request's state machine, typed (see exchange.pyx).

from velocity_fast.admission.bands cimport Item
from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.gateway.identity cimport Tenant
from velocity_fast.gateway.ingress cimport Ingress
from velocity_fast.http.message cimport Request
from velocity_fast.admission.controller cimport Admission, Lease, Ticket
from velocity_fast.admission.estimators cimport OutputEstimate
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.routing.router cimport Router
from velocity_fast.server.connection cimport Responder
from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection


cdef class Exchange(ResponseHandler):
    cdef readonly Ingress ingress
    cdef object loop
    cdef readonly Request req
    cdef readonly Responder resp
    cdef readonly str route
    cdef readonly object pool
    cdef readonly Ticket ticket
    cdef readonly RouteInfo info
    cdef readonly bytes body
    cdef readonly str rid
    cdef readonly int state
    cdef Admission adm
    cdef Item qitem
    cdef readonly Lease lease
    cdef readonly Endpoint ep
    cdef readonly UpstreamConnection conn
    cdef list tried
    cdef readonly double queue_s
    cdef str up_path              # the engine's path: the client's, or /v1/completions for /generate
    cdef object reshape           # None, or a callable that reshapes a whole 2xx answer (/generate)
    cdef bint headed
    cdef object task
    cdef str ct
    cdef int status
    cdef long events
    cdef bint first
    cdef bint engine_failed
    cdef bint done_sent           # a stream's data: [DONE] was relayed to the client
    cdef object error_text
    # Tokens: the configured tenant (its quota and figures; None for any other), the
    # tokens drawn from its quota at admission, the prompt estimated from the body, and
    # the engine's usage once read (a stream's final usage chunk, a whole answer's body).
    cdef Tenant tenant
    cdef double q_est
    cdef long long prompt_est
    cdef bint stream_req          # the client asked for a stream
    cdef bint want_usage          # something settles from usage: a configured tenant, or token fairness
    cdef bint usage_strip         # the gateway asked for usage: the usage chunk is not relayed
    cdef bint usage_seen
    cdef long long u_prompt
    cdef long long u_cached
    cdef long long u_completion
    cdef bint accounted
    # The request named no max tokens: its pool's estimate of such replies, which the
    # answer's usage teaches (None: it named them).
    cdef OutputEstimate open_est
    # A sampled request's trace (gateway/tracing.py's Trace); None: not traced, the
    # request path as without tracing.
    cdef object trace

    cdef bint waiting(self) except -1
    cdef void granted(self, Lease lease) except *
    cdef _granted(self)
    cpdef start(self)
    cdef _admitted(self, Lease lease)
    cdef _dispatch(self)
    cdef Endpoint _pick(self, Router router, exclude)
    # on_sent .. on_error: ResponseHandler's, overridden (upstream/connection.pxd).
    cdef _relay(self, UpstreamConnection conn, bytes data, bint framed)
    cdef bytes _usage_event(self, bytes data, bint framed)
    cdef _stream_done(self, UpstreamConnection conn)
    cdef _stream_failed(self, e)
    cdef _answer(self, UpstreamConnection conn)
    cdef _invalid_status(self, UpstreamConnection conn, int status)
    cdef _engine_failed(self, e)
    cdef _end(self)
    cdef _fail_lease(self, error_text)
    cdef _account(self, long long prompt, long long cached, long long completion, bint known)
    cdef _account_stream(self)
    cdef void _learn_open(self) except *
    cdef _reject_counted(self, str reason)
    cdef _refuse(self, int status, str reason, str message, retry_after=*)
    cdef _crashed(self)
    cdef _cut(self)
    cdef void _drop_engine(self) except *
    cdef _left_after_done(self)
    cpdef list base_headers(self)
    cdef void _trace_end(self, int status, reason, retry_after, body) except *


# A new exchange for the front door (gateway/ingress.pyx) to start.
cdef Exchange new_exchange(Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket, RouteInfo info,
                           bytes body, str rid)

# Set a new exchange's fields (of Exchange or a subclass made with __new__): the front
# door's state for it, as new_exchange does; gateway/pd.pyx's PdExchange is made with it.
cdef Exchange fill_exchange(Exchange x, Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket,
                            RouteInfo info, bytes body, str rid)


# /v1/responses and /v1/messages: their usage read from their own events (exchange.pyx).
cdef class GenExchange(Exchange):
    cdef bytes tail               # a stream's last event line, not yet ended
    cdef _read_events(self, bytes data)


# Starts one (the front door's place_generation, gateway/ingress.pyx).
cpdef start_generation(Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket, RouteInfo info,
                       bytes body, str rid, tenant, double q_est, bint stream, asked=*)
