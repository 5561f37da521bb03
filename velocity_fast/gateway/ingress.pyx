"""The gateway's front door, compiled: the client port's handler (``handle_client``), the
proxy routes' validation and placing (``proxy``: band, tenant, SLA, pool, the body to
forward) up to the ``Exchange`` that takes a request from admission to its answer
(gateway/exchange.pyx), the native /generate through the same checks (``generate``: its
own body and answer shapes, the same pool, context, quota and exchange), and the books
every answer ends with (``settle``, ``count_request``, ``internal_error``).

``Ingress`` holds what every proxied request reads of its gateway as C fields; the
Gateway (gateway/app.py) supplies them: router, admission, monitor, metrics, and reject
and the other routes through its small interface.
"""

cimport cython

import logging
import math
import os
import time

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeASCII

from velocity_fast.admission.bands cimport VF_BYTES_PER_TOKEN
from velocity_fast.admission.controller cimport Admission, Lease, Ticket
from velocity_fast.admission.estimators cimport OutputEstimate
from velocity_fast.metrics.values cimport Value
from velocity_fast.gateway.exchange cimport Exchange, new_exchange, start_generation
from velocity_fast.gateway.pd cimport new_pd_exchange
from velocity_fast.gateway.requests cimport (P_FIELDS, P_MAX_COMPLETION_TOKENS, P_MAX_TOKENS, P_MODEL, P_PRIORITY,
                                           P_SLA_MS, P_STREAM, P_STREAM_OPTIONS, P_USER, ask_usage, decode_fields,
                                           strip_own_fields, take_digests)
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.routing.router cimport Router
from velocity_fast.server.connection cimport Responder

from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.fleet.endpoint cimport Endpoint, Pool
from velocity_fast.gateway.identity cimport Identity, Tenant, tenant_by_header, tenant_draw_tokens, tenant_settle_tokens
from velocity_fast.http.heads cimport rid_header
from velocity_fast.http.message cimport OWN_APIKEY, OWN_AUTH, OWN_PRIORITY, OWN_PROFILE, OWN_RID, OWN_SESSION
from velocity_fast.http.message cimport OWN_SLA, OWN_TENANT, Request, short_text
from velocity_fast.lowlevel.fmt cimport str_eq

import msgspec
import orjson

from velocity_fast.admission.estimators import OPEN_START_CHAT, OPEN_START_TEXT
from velocity_fast.gateway.errors import BadRequest, context_error
from velocity_fast.gateway.requests import decode_generate, too_deep
from velocity_fast.routing.errors import UnknownProfile
from velocity_fast.routing.settings import PROFILE_HEADER, SESSION_HEADER

log = logging.getLogger("velocity.gateway")

cdef object _UNSET = msgspec.UNSET  # ProxyRequest's priority and sla_ms when the body has none


# req-<6 hex per process><6 hex of a counter>: the counter makes ids unique within the
# process (for 16.7 million requests in a row), the prefix across processes.
cdef char _ID[16]
cdef unsigned long _id_next = int.from_bytes(os.urandom(3), "big")
cdef const char* _HEX = b"0123456789abcdef"


cdef _init_id():
    cdef bytes prefix = ("req-" + os.urandom(3).hex()).encode("ascii")
    cdef int i
    for i in range(10):
        _ID[i] = prefix[i]


_init_id()


cpdef str new_request_id():
    """req-<12 hex>: no system call per request (os.urandom would be one), no formatting."""
    global _id_next
    cdef unsigned long n = _id_next & 0xFFFFFF
    cdef int i
    _id_next += 1
    for i in range(6):
        _ID[15 - i] = _HEX[(n >> (4 * i)) & 15]
    return PyUnicode_DecodeASCII(_ID, 16, NULL)


# The routes of the front door: chat (True), completions (False), the native /generate.
cdef object _NATIVE = object()
cdef dict _PROXY_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False, "/generate": _NATIVE}
cdef str _HEALTH = "/health"
cdef str _last_path = None  # the last path asked and what _PROXY_ROUTES said of it
cdef object _last_chat = None
cdef str _POST = "POST"


cdef class Ingress:
    """What every proxied request reads of its gateway: C fields instead of instance-dict
    look-ups. A reload assigns new ones (admission, router, identity, band names); a
    request holds what it read when it arrived.

    ``app`` is the gateway above (gateway/app.py), called through a small interface for
    what is not the proxy path: ``health(resp)``, ``route_other(req, resp)`` (every other
    route), ``reject(resp, route, status, reason, message, band, headers, retry_after,
    from_admission=...)``, ``sla_for(header, body_value)``, and the books of answers outside
    the proxy's: ``refuse_key(port, path)`` (a 401) and ``count_answer(path, status)``."""

    def answer_internal_error(self, Request req, Responder resp, what=None):
        """The client server's on_error: the handler raised (called in its except clause)
        or, with ``what``, returned without an answer."""
        h = req.header_dict()
        internal_error(self, req, resp, h.get("x-request-id") or new_request_id(), _error_route(req.path), "-",
                       what)


# The routes an internal error is counted under (any other path: "other", so that a
# client cannot make label values of its own).
cdef frozenset _ERROR_ROUTES = frozenset(("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models",
                                          "/stats", "/health"))


cdef str _error_route(str path):
    return path if path in _ERROR_ROUTES else "other"


cdef internal_error(Ingress ingress, Request req, Responder resp, str rid, str route, str band, what):
    """Whatever failed inside the gateway, on the way out: logged once with its traceback,
    counted (velocity_requests_total{status="500"} and velocity_internal_errors_total), and
    a 500 in the error shape that carries the request id; a started answer is cut short."""
    log.error("internal error on %s %s (request %s)%s", req.method, req.path, rid, f": {what}" if what else "",
              exc_info=what is None, extra={"request_id": rid, "status": 500})
    answered = resp.finished  # (an answer already sent is counted as what it was)
    try:
        ingress.metrics.internal_errors.labels(route).inc()
        if not answered:
            count_request(ingress, route, 500, band)
    finally:  # the client is answered even if the books fail
        if not resp.started:
            resp.send_error(500, f"Internal server error (request {rid}).", headers=rid_header(rid))
        elif not answered:
            resp.abort()  # a stream that cannot be finished: the client sees it cut short


cdef object _UNCHECKED = object()  # proxy(): the key not checked yet


cdef object _presented_key(Request req):
    """The key the request presents, as Identity.key_of finds it: read where the scanner
    found its Authorization and X-Api-Key values when it can, so that a client's whole
    header dict (17 lines from the OpenAI SDK) is not made for one look-up; else from the
    dict. A scanned value holds only printable ASCII and tabs, so key_of's steps are
    these: the scheme is what comes before the first space, "bearer" in any case, and the
    token what follows, stripped of spaces and tabs."""
    cdef const char* p
    cdef Py_ssize_t n, a, b
    if not req.own_direct():
        return Identity.presented_key(req.header_dict())
    if req.own & (1u << OWN_AUTH):
        p = PyBytes_AS_STRING(req.head_data) + req.own_vs[OWN_AUTH]
        n = req.own_ve[OWN_AUTH] - req.own_vs[OWN_AUTH]
        if (n > 7 and p[6] == c' ' and (p[0] | 0x20) == c'b' and (p[1] | 0x20) == c'e'
                and (p[2] | 0x20) == c'a' and (p[3] | 0x20) == c'r' and (p[4] | 0x20) == c'e'
                and (p[5] | 0x20) == c'r'):
            a = 7
            b = n
            while a < b and (p[a] == c' ' or p[a] == c'\t'):
                a += 1
            while b > a and (p[b - 1] == c' ' or p[b - 1] == c'\t'):
                b -= 1
            if b > a:
                return short_text(p + a, b - a)
    return req.own_text(OWN_APIKEY)


def handle_client(Ingress ingress, Request req, Responder resp):
    """Gateway.handle, the client port's handler: /health, the key check (every path but
    /health), the proxy routes (arranged from callbacks); the rest is Gateway.route_other's."""
    cdef str path = req.path
    cdef Identity identity
    if str_eq(path, _HEALTH):
        return ingress.app.health(resp)
    identity = ingress.identity
    bound = None
    if identity.required:
        ok, bound = identity.authenticate_key(_presented_key(req))
        if not ok:
            ingress.app.refuse_key("client", path)
            return resp.send_error(401, "Missing or invalid API key.", type="AuthenticationError")
    global _last_path, _last_chat
    if path is _last_path:  # the scanner shares a path's text while it repeats
        chat = _last_chat
    else:
        chat = _PROXY_ROUTES.get(path)
        _last_path, _last_chat = path, chat
    if chat is not None:
        if not str_eq(req.method, _POST):
            ingress.app.count_answer(path, 405)
            return resp.send_error(405, f"Use POST for {path}.")
        if chat is _NATIVE:
            return generate(ingress, req, resp)
        return proxy(ingress, req, resp, path, chat, bound)
    return ingress.app.route_other(req, resp)


cdef list _names_seen = None
cdef str _default_seen = None


cdef str _default_of(list names, str default):
    """The band of a request that names none: ``default`` (admission.default_band), else
    "normal", else the middle band, of the last names list seen (the gateway replaces its
    list on a reload, never changes it in place)."""
    global _names_seen, _default_seen
    if default is not None:
        return default
    if names is _names_seen and names is not None:
        return _default_seen
    band = "normal" if "normal" in names else names[len(names) // 2]
    _names_seen, _default_seen = names, band
    return band


cpdef str band_for(list names, raw, tenant, str default=None):
    """The band a request asks for (header, then body; ``names`` highest first), capped by
    its tenant's max_band. A number is vLLM's priority: lower runs earlier and 0, vLLM's
    default, is the default band; each step below 0 is a band higher, each above 0 a band
    lower, to the first or the last. A request that names none gets ``default``
    (admission.default_band); one that names a band that does not exist is a 400 naming
    the bands, not a silent default: the header and the body's string ``priority`` are
    this gateway's own, so an unknown name is a mistake to show."""
    cdef str band
    if raw is None or raw == "":
        band = _default_of(names, default)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        band = _default_of(names, default)
        if raw:
            band = names[min(max(names.index(band) + raw, 0), len(names) - 1)]
    else:
        band = str(raw).strip().lower()
        if band not in names:
            raise BadRequest(f"Unknown priority band {raw!r}; bands are {names}.", "priority")
    if tenant is not None:
        cap = (<Tenant>tenant).max_band if type(tenant) is Tenant else tenant.max_band
        if cap is not None and names.index(band) < names.index(cap):
            band = cap
    return band


cpdef proxy(Ingress ingress, Request req, Responder resp, str route, bint chat, bound=_UNCHECKED):
    """Gateway.handle's /v1/chat/completions and /v1/completions: validate, place in a band
    and a pool, then an Exchange takes it from admission to the answer. ``bound``: the
    tenant the request's key bound (None: none), where handle_client checked it."""
    cdef PyObject* f[P_FIELDS]  # the request's fields, read at once (borrowed: r holds them)
    cdef bint compact  # the decoder left messages and prompt as compact JSON text
    cdef Identity identity = ingress.identity
    cdef dict h = None
    cdef Exchange x
    cdef double q_est
    cdef bint stream, strip, want
    cdef unsigned int own
    cdef const char* tenant_p = NULL  # the tenant header's bytes (in raw), when read where they lie
    cdef Py_ssize_t tenant_n = 0
    cdef Tenant known = None  # the tenant those bytes named before
    cdef OutputEstimate open_est = None  # no max tokens named: the pool's estimate of the reply
    # The gateway's own headers, looked up only when the request has any (most have none):
    # read where the scanner found them, no dict (the router is given one only of what it
    # reads, when the request has any).
    rid = tenant_h = prio = sla = route_h = None
    if req.gateway_headers:
        if req.own_direct():
            own = req.own
            if own & (1u << OWN_RID):
                rid = req.own_text(OWN_RID)
            if own & (1u << OWN_TENANT):
                if identity.required:  # a key's tenant wins over the header: no shortcut
                    tenant_h = req.own_text(OWN_TENANT)
                else:
                    raw = req.head_data  # (held: tenant_p lies in it)
                    tenant_p = PyBytes_AS_STRING(raw) + req.own_vs[OWN_TENANT]
                    tenant_n = req.own_ve[OWN_TENANT] - req.own_vs[OWN_TENANT]
                    known = tenant_by_header(identity, tenant_p, tenant_n)
                    tenant_h = known.name if known is not None else req.own_text(OWN_TENANT)
            if own & (1u << OWN_PRIORITY):
                prio = req.own_text(OWN_PRIORITY)
            if own & (1u << OWN_SLA):
                sla = req.own_text(OWN_SLA)
            if own & ((1u << OWN_PROFILE) | (1u << OWN_SESSION)):
                route_h = {PROFILE_HEADER: req.own_text(OWN_PROFILE), SESSION_HEADER: req.own_text(OWN_SESSION)}
        else:
            h = req.own_headers()
            rid = h.get("x-request-id")
            tenant_h = h.get("x-velocity-tenant")
            prio = h.get("x-velocity-priority")
            sla = h.get("x-velocity-sla-ms")
            route_h = h
    if not rid:
        rid = new_request_id()
    band = "-"
    try:
        r = decode_fields(req.body, chat, f, &compact)  # a ProxyRequest, its fields left in f
        if known is not None:  # (no key to check: the header's tenant)
            tenant_name = tenant_h
            tenant = known
        else:
            if not identity.required:
                bound = None
            elif bound is _UNCHECKED:
                bound = identity.authenticate_key(_presented_key(req))[1]
            tenant_name = identity.tenant_name(bound, tenant_h, <object>f[P_USER])  # tenant_for, without a tuple
            tenant = identity.tenant_named(bound, tenant_name)
            if tenant is not None:
                if tenant_p != NULL and tenant_name is tenant_h:
                    identity.keep_header(tenant_p, tenant_n, <Tenant>tenant)
                # The tenant's own name (an equal str): the one that later requests, found
                # by by_header, pass on, so admission's dicts by tenant find it by identity.
                tenant_name = (<Tenant>tenant).name
        if prio is None:
            prio = <object>f[P_PRIORITY]
            if prio is _UNSET:  # not in the body
                prio = None
        band = band_for(ingress.band_names, prio, tenant, ingress.default_band)
        sla_ms = <object>f[P_SLA_MS]
        if sla_ms is _UNSET:
            sla_ms = None
        if sla is not None:
            sla_ms = ingress.app.sla_for(sla, sla_ms)
        if sla_ms is None and tenant is not None:
            sla_ms = (<Tenant>tenant).sla_ms  # the tenant's SLA, else (None) the server's
        model = <object>f[P_MODEL] or ingress.default_model
        if type(model) is str:
            # The last model named, as one object: its hash is kept, so the look-ups by
            # model below (routing, pool, admission) do not hash a new string each time.
            if str_eq(model, ingress._last_model):
                model = ingress._last_model
            else:
                ingress._last_model = model
        info = (<Router?>ingress.router).route_info(model, r, route_h, compact,
                                                    take_digests(r) if compact else None)
    except (BadRequest, UnknownProfile) as e:
        count_request(ingress, route, 400, band)
        return resp.send_error(400, str(e), param=e.param, headers=rid_header(rid))
    except RecursionError:  # prefix routing decoding messages nested past its depth
        e = too_deep()
        count_request(ingress, route, 400, band)
        return resp.send_error(400, str(e), headers=rid_header(rid))
    asked = <object>f[P_MAX_COMPLETION_TOKENS] or <object>f[P_MAX_TOKENS]
    pool = _pool_for(ingress, resp, route, band, rid, model, asked,
                     "max_completion_tokens" if <object>f[P_MAX_COMPLETION_TOKENS] else "max_tokens")
    if pool is None:
        return None  # answered
    body = strip_own_fields(req.body, r)
    if asked is None:
        # The reply runs until the model stops: taken for what the pool's engines returned
        # for such requests (their usage teaches it, below), in admission and the quota alike.
        open_est = (<Admission>ingress.admission).open_estimate(model, chat)
        max_tokens = open_est.expect() if open_est is not None else (OPEN_START_CHAT if chat else OPEN_START_TEXT)
    else:
        max_tokens = asked
    q_est = 0.0
    if tenant is not None and not _draw_quota(ingress, req, resp, route, band, rid, <Tenant?>tenant, tenant_name,
                                              PyBytes_GET_SIZE(body), <long>max_tokens, &q_est):
        return None  # answered
    stream = <object>f[P_STREAM] is True
    strip = False
    # Usage is read only where something settles from it: a configured tenant (its
    # quota, its figures), token fairness on what was served, or the estimate of replies
    # that name no max tokens.
    want = tenant is not None or (<Admission>ingress.admission).settle_usage or open_est is not None
    if stream and want:
        options = <object>f[P_STREAM_OPTIONS]
        if options is None or not options.include_usage:
            # Asked of the engine for the settlement, cut from the client's stream.
            body = ask_usage(body, options is not None)
            strip = True
    x = _exchange(ingress, req, resp, route, pool, band, tenant_name, sla_ms, <long>max_tokens, model, info, body,
                  rid, tenant, q_est)
    x.stream_req = stream
    x.want_usage = want
    x.usage_strip = strip
    x.open_est = open_est
    if ingress.tracing is not None:  # tracing on: this request's trace, if it is sampled
        x.trace = ingress.tracing.begin(x, chat, asked)
    # No task: admission, the engine connection and the client meet in callbacks,
    # a stream's events included.
    x.start()


# -- what every route of the front door goes through once its body is read --------------------

cdef object _pool_for(Ingress ingress, Responder resp, str route, str band, str rid, model, asked, str param):
    """The pool that serves ``model``, where ``asked`` output tokens (None: not named) fit
    its engines' context; else None, the client answered (404, 400 naming ``param``)."""
    cdef long limit
    pool = ingress.pools.get(model) if model else None
    if pool is None:
        count_request(ingress, route, 404, band)
        resp.send_error(404, f"The model `{model}` does not exist.", type="NotFoundError",
                        param="model", headers=rid_header(rid))
        return None
    if asked is not None and type(pool) is Pool:
        # As vLLM answers: a completion that cannot fit the engines' context beside even a
        # one-token prompt is a 400 here, not a request admission would queue and charge.
        # (asked: at most MAX_TOKENS_LIMIT, checked when the body was decoded.)
        limit = (<Pool>pool).context_length(ingress.max_model_len)
        if <long>asked >= limit:
            count_request(ingress, route, 400, band)
            resp.send_error(400, context_error(limit, asked), param=param, headers=rid_header(rid))
            return None
    return pool


cdef bint _draw_quota(Ingress ingress, Request req, Responder resp, str route, str band, str rid, Tenant t,
                      tenant_name, Py_ssize_t nbytes, long max_tokens, double* q_est) except -1:
    """Draw a configured tenant's quota for a request of ``nbytes`` forwarded, ``max_tokens``
    out: its tokens per minute (the estimate, ``q_est``, must fit in what is left), then its
    request rate. False: over one of them, the client answered (429 ``rate-limit``)."""
    cdef double wait, now
    if t.tpm is not None:
        q_est[0] = nbytes / VF_BYTES_PER_TOKEN + max_tokens
        # Refilled to when the request was read (this pass's clock), no second read.
        now = req.received_at
        wait = tenant_draw_tokens(t, q_est[0], now if now > 0.0 else monotonic())
        if wait:
            count_reject(t, "rate-limit")
            ingress.app.reject(resp, route, 429, "rate-limit", f"Tenant {tenant_name!r} is over its tokens per minute.",
                               band, rid_header(rid), wait)
            return False
    wait = t.take() if t.rate is not None else 0.0  # (no call for a tenant with no request rate)
    if wait:
        if q_est[0]:
            tenant_settle_tokens(t, -q_est[0])
        count_reject(t, "rate-limit")
        ingress.app.reject(resp, route, 429, "rate-limit", f"Tenant {tenant_name!r} is over its request rate.",
                           band, rid_header(rid), wait)
        return False
    return True


cdef Exchange _exchange(Ingress ingress, Request req, Responder resp, str route, pool, str band, tenant_name, sla_ms,
                        long max_tokens, model, RouteInfo info, bytes body, str rid, tenant, double q_est):
    """The Exchange that takes the request from admission to its answer, with its ticket;
    ``q_est``: the tokens drawn from ``tenant``'s quota (settled from the answer's usage)."""
    cdef Exchange x
    cdef Ticket ticket = Ticket.__new__(Ticket)  # the fields are already what Ticket() would make of them
    ticket.band = band
    ticket.tenant = tenant_name
    ticket.sla_ms = sla_ms
    ticket.max_tokens = max_tokens
    ticket.prompt_bytes = len(body)
    ticket.model = model
    if type(pool) is Pool and (<Pool>pool).pd is not None:  # prefill/decode roles (gateway/pd.pyx)
        x = new_pd_exchange(ingress, req, resp, route, <Pool>pool, ticket, info, body, rid)
    else:
        x = new_exchange(ingress, req, resp, route, pool, ticket, info, body, rid)
    x.tenant = tenant
    x.q_est = q_est
    x.prompt_est = <long long>(ticket.prompt_bytes / VF_BYTES_PER_TOKEN)
    return x


cdef str _GENERATE = "/generate"


cdef count_request(Ingress ingress, str route, int status, str band):
    """velocity_requests_total{route, status, band} += 1: the child held by the metric for
    these very values, found without a call (the metric makes it on first use)."""
    if route is ingress._last_route and band is ingress._last_band and status == ingress._last_status:
        # the same as the last request's (shared strs): its child again, no tuple to make
        # (the metric never drops a child of this family: its labels name no endpoint)
        ingress._last_count.value += 1.0
        return
    metric = ingress._requests_metric
    if metric is None:  # the gateway's metrics are made once, with it
        metric = ingress._requests_metric = ingress.metrics.requests
    child = (<dict>metric.by_values).get((route, status, band))
    if type(child) is Value:
        (<Value>child).value += 1.0
        ingress._last_route, ingress._last_band, ingress._last_status, ingress._last_count = route, band, status, child
    else:
        metric.labels(route, status, band).inc()


cpdef settle(Ingress ingress, str route, str band, Endpoint ep, Lease lease, int status, bint engine_failed, bint ok, error_text,
             long events):
    """The books of one relayed answer: endpoint health, the lease's outcome, the request count."""
    if status >= 500 or engine_failed:
        ingress.monitor.passive_failure(ep, connect=False)
        ep.errors += 1
    elif ep.failures:  # a success resets the failures counted (there is nothing else to do)
        ingress.monitor.passive_success(ep)
    ep.served += 1
    lease.release("completed" if ok else "failed", error_text, events)
    count_request(ingress, route, status, band)


cpdef generate(Ingress ingress, Request req, Responder resp):
    """POST /generate, the native route (the key already checked by ``handle_client``): the
    same checks as the OpenAI routes (band, tenant, SLA, profile, pool, context, quota) and
    the same exchange. Its body becomes a completions request to the engine's
    /v1/completions, and a whole 2xx JSON answer is reshaped into the native one
    (``_native_answer``); streams and errors go on as the engine sent them (the body asks
    a stream's usage itself: its chunk is relayed)."""
    cdef Identity identity = ingress.identity
    cdef dict h = req.header_dict()
    cdef Exchange x
    cdef double q_est = 0.0
    rid = h.get("x-request-id") or new_request_id()
    band = "-"
    try:
        r = decode_generate(req.body)
        bound = identity.authenticate(h)[1] if identity.required else None
        tenant_name = identity.tenant_name(bound, h.get("x-velocity-tenant"), None)
        tenant = identity.tenant_named(bound, tenant_name)
        if tenant is not None:
            tenant_name = (<Tenant>tenant).name
        prio = h.get("x-velocity-priority")
        band = band_for(ingress.band_names, prio if prio is not None else r.priority, tenant, ingress.default_band)
        sla_ms = r.sla_ms
        sla = h.get("x-velocity-sla-ms")
        if sla is not None:
            sla_ms = ingress.app.sla_for(sla, sla_ms)
        if sla_ms is None and tenant is not None:
            sla_ms = (<Tenant>tenant).sla_ms  # the tenant's SLA, else (None) the server's
        model = r.model or ingress.default_model
        info = (<Router?>ingress.router).route_info(model, r, h)
    except (BadRequest, UnknownProfile) as e:
        count_request(ingress, _GENERATE, 400, band)
        return resp.send_error(400, str(e), param=e.param, headers=rid_header(rid))
    pool = _pool_for(ingress, resp, _GENERATE, band, rid, model, r.max_tokens, "max_tokens")
    if pool is None:
        return None  # answered
    payload = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "stream": r.stream}
    if r.temperature is not None:
        payload["temperature"] = r.temperature
    if r.stream:
        payload["stream_options"] = {"include_usage": True}
    body = orjson.dumps(payload)
    if tenant is not None and not _draw_quota(ingress, req, resp, _GENERATE, band, rid, <Tenant?>tenant, tenant_name,
                                              len(body), <long>r.max_tokens, &q_est):
        return None  # answered
    x = _exchange(ingress, req, resp, _GENERATE, pool, band, tenant_name, sla_ms, <long>r.max_tokens, model, info,
                  body, rid, tenant, q_est)
    x.up_path = "/v1/completions"
    x.reshape = _native_answer
    x.stream_req = r.stream
    x.want_usage = tenant is not None or x.adm.settle_usage
    if ingress.tracing is not None:  # tracing on: this request's trace, if it is sampled
        x.trace = ingress.tracing.begin(x, False, r.max_tokens)
    x.start()


cpdef place_generation(Ingress ingress, Request req, Responder resp, str route, str rid, str band, tenant,
                       tenant_name, sla_ms, model, RouteInfo info, bytes body, max_tokens, str param, bint stream):
    """/v1/responses and /v1/messages (gateway/routes.py decodes and places them) from their
    pool on, through the same checks as the OpenAI routes: the pool (404), the context
    (400 naming ``param``), the tenant's quota (429); then their exchange. ``max_tokens``:
    None when the request names none (taken for 256 in admission and the quota)."""
    cdef double q_est = 0.0
    cdef long out = <long>max_tokens if max_tokens is not None else 256
    pool = _pool_for(ingress, resp, route, band, rid, model, max_tokens, param)
    if pool is None:
        return None  # answered
    if tenant is not None and not _draw_quota(ingress, req, resp, route, band, rid, <Tenant?>tenant, tenant_name,
                                              len(body), out, &q_est):
        return None  # answered
    cdef Ticket ticket = Ticket(band=band, tenant=tenant_name, sla_ms=sla_ms, max_tokens=out,
                                prompt_bytes=len(body), model=model)
    start_generation(ingress, req, resp, route, pool, ticket, info, body, rid, tenant, q_est, stream, max_tokens)


@cython.boundscheck(True)  # an engine's answer may hold an empty list: an IndexError, a 502
@cython.wraparound(True)
def _native_answer(Exchange x, bytes body):
    """The native answer of /generate from the engine's whole completion (None: the body
    is not what a completion looks like, a 502)."""
    try:
        obj = orjson.loads(body)
        text = obj["choices"][0].get("text", "")
        tokens = int((obj.get("usage") or {}).get("completion_tokens") or 0)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError, ValueError):
        return None
    ticket = x.ticket
    latency = time.monotonic() - x.req.received_at
    execution = max(latency - x.queue_s, 1e-9)
    # The SLA judged is the one admission applied (the request's own, its tenant's, its
    # band's or the server's); null when it had none (a band without a deadline).
    lease = x.lease
    sla_s = lease.deadline - lease.arrived_at if lease is not None else math.inf
    return orjson.dumps({"request_id": x.rid, "response": text, "latency_seconds": round(latency, 6),
                         "queue_time_seconds": round(x.queue_s, 6),
                         "execution_time_seconds": round(execution, 6), "tokens_generated": tokens,
                         "tokens_per_second": round(tokens / execution, 3),
                         "sla_met": latency <= sla_s if math.isfinite(sla_s) else None,
                         "priority": ticket.band})
