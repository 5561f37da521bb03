"""One proxied request driven by callbacks, without a task, compiled.

Admission grants at once or later (the exchange is the queue's waiter), the request
goes out on a pooled engine connection, and the engine's answer is sent on from its
parser callbacks: a whole answer from the last one, a stream event by event as each
piece arrives (reading from the engine pauses while the client's buffer is full).

Every proxied route takes it: the OpenAI routes as they are, /generate with its answer
reshaped (``start_native``). A connect failure is retried once elsewhere. Every admitted
request ends its lease exactly once, a client that leaves included ("cancelled", engine
connection aborted). The Gateway supplies the shared parts: router, admission, monitor,
metrics and _reject.
"""

import logging
import os

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.string cimport memcmp, memcpy

from velocity_fast.admission.controller cimport Admission, Lease, Ticket, set_waiter
from velocity_fast.metrics.values cimport Value
from velocity_fast.gateway.requests cimport (P_FIELDS, P_MAX_COMPLETION_TOKENS, P_MAX_TOKENS, P_MODEL, P_PRIORITY,
                                           P_SLA_MS, P_USER, decode_fields, strip_own_fields)
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.routing.router cimport Router
from velocity_fast.server.connection cimport Responder
from velocity_fast.upstream.pool cimport UpstreamPool
from velocity_fast.upstream.connection cimport Listener, UpstreamConnection

from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.fleet.endpoint cimport Endpoint, Pool
from velocity_fast.gateway.identity cimport Identity, Tenant
from velocity_fast.http.message cimport Request
from velocity_fast.lowlevel.fmt cimport (_digits, cat, dec, memmem, latin1, put, put_bytes, put_tenths, starts, str_eq,
                                      tenths)

import msgspec

from velocity_fast.admission.errors import Rejected
from velocity_fast.gateway.errors import BadRequest, context_error
from velocity_fast.gateway.requests import too_deep
from velocity_fast.routing.errors import UnknownProfile
from velocity_fast.http.errors import stream_error_event

log = logging.getLogger("velocity.gateway")

cdef object _UNSET = msgspec.UNSET  # ProxyRequest's priority and sla_ms when the body has none
cdef str _JSON = intern("application/json")  # one object with server.pyx's: its head needs no look-up
cdef bytes _H_RID = b"x-request-id: "
cdef bytes _H_EP = b"\r\nx-velocity-endpoint: "
cdef bytes _H_QMS = b"\r\nx-velocity-queue-ms: "
cdef bytes _H_BAND = b"\r\nx-velocity-band: "

# An exchange's stages.
cdef enum:
    _ADMITTING = 0
    _QUEUED = 1
    _ADMITTED = 2
    _DONE = 3


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


cdef dict _PROXY_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}
cdef str _HEALTH = "/health"
cdef str _last_path = None  # the last path asked and what _PROXY_ROUTES said of it
cdef object _last_chat = None
cdef str _POST = "POST"


cdef inline list _rid_headers(str rid):
    """x-request-id, the header every answer carries (made only for an error's: a relayed
    answer's head is written whole by Exchange._out_lines)."""
    return [("x-request-id", rid)]


# From this size on a body is not copied behind its head: the two leave in one writev.
cdef Py_ssize_t _JOIN_MAX = 2048


cdef object _engine_request(bytes head, str rid, bytes auth, bytes body):
    """The engine request: ``head`` (request line, host, content type), x-request-id,
    ``auth``, Content-Length and ``body``, in one allocation; for a body past
    _JOIN_MAX, the head so made and the body itself, as a pair (no copy of the body)."""
    cdef char digits[24]
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef int nd = _digits(digits + 24, <unsigned long long>n)
    cdef bint apart = n > _JOIN_MAX
    cdef char* p
    if not latin1(rid):
        rid_b = rid.encode("latin-1")  # raises as the header could not be written
        return cat((head, b"x-request-id: ", rid_b, b"\r\n", auth, b"content-length: ", dec(n),
                    b"\r\n\r\n", body))
    out = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(head) + 14 + len(rid) + 2 + PyBytes_GET_SIZE(auth)
                                    + 16 + nd + 4 + (0 if apart else n))
    p = put_bytes(PyBytes_AS_STRING(out), head)
    memcpy(p, b"x-request-id: ", 14)
    p = put(p + 14, rid)
    memcpy(p, b"\r\n", 2)
    p = put_bytes(p + 2, auth)
    memcpy(p, b"content-length: ", 16)
    memcpy(p + 16, digits + 24 - nd, nd)
    p += 16 + nd
    memcpy(p, b"\r\n\r\n", 4)
    if apart:
        return (out, body)
    put_bytes(p + 4, body)
    return out


cdef inline str _content_type(UpstreamConnection conn):
    """The engine answer's content type; JSON when it names none (as vLLM's always is)."""
    ct = conn.content_type
    return _JSON if ct is None else ct


cdef long _events(bytes data, Py_ssize_t* err_at):
    """How many SSE events begin in ``data`` (``data: `` lines), in one pass that also
    finds the first of them that is an error event (``data: {"error"``): its offset in
    ``err_at``, else -1. ``data.count`` would be a method call per piece."""
    cdef const char* s = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0
    cdef const char* hit
    cdef long count = 0
    err_at[0] = -1
    while True:
        hit = <const char*>memmem(s + pos, n - pos, b"data: ", 6)
        if hit == NULL:
            return count
        count += 1
        pos = hit - s
        if err_at[0] < 0 and n - pos >= 14 and memcmp(hit + 6, b'{"error"', 8) == 0:
            err_at[0] = pos
        pos += 6


cdef class Ingress:
    """What every proxied request reads of its gateway: C fields instead of instance-dict
    look-ups. A reload assigns new ones (admission, router, identity, band names); a
    request holds what it read when it arrived.

    ``app`` is the gateway above (gateway/app.py), called through a small interface for
    what is not the proxy path: ``_health(resp)``, ``_route(req, resp)`` (every other
    route), ``_reject(resp, route, status, reason, message, band, headers, retry_after,
    from_admission=...)`` and ``_sla_for(header, body_value)``."""

    def _internal_error(self, Request req, Responder resp, what=None):
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


cdef internal_error(Ingress gw, Request req, Responder resp, str rid, str route, str band, what):
    """Whatever failed inside the gateway, on the way out: logged once with its traceback,
    counted (velocity_requests_total{status="500"} and velocity_internal_errors_total), and
    a 500 in the error shape that carries the request id; a started answer is cut short."""
    log.error("internal error on %s %s (request %s)%s", req.method, req.path, rid, f": {what}" if what else "",
              exc_info=what is None, extra={"request_id": rid, "status": 500})
    answered = resp.finished  # (an answer already sent is counted as what it was)
    try:
        gw.metrics.internal_errors.labels(route).inc()
        if not answered:
            count_request(gw, route, 500, band)
    finally:  # the client is answered even if the books fail
        if not resp.started:
            resp.send_error(500, f"Internal server error (request {rid}).", headers=_rid_headers(rid))
        elif not answered:
            resp.abort()  # a stream that cannot be finished: the client sees it cut short


def _run_grants(Ingress gw):
    """The exchanges granted a lease since the last run, in the order of their grants."""
    cdef Exchange x
    grants, gw._grants = gw._grants, []
    for x in grants:
        try:
            x._granted()
        except Exception:  # one exchange's failure must not strand the others
            log.exception("granted exchange failed")


def handle_client(Ingress gw, Request req, Responder resp):
    """Gateway.handle, the client port's handler: /health, the key check (every path but
    /health), the proxy routes (arranged from callbacks); the rest is Gateway._route's."""
    cdef str path = req.path
    cdef Identity identity
    if str_eq(path, _HEALTH):
        return gw.app._health(resp)
    identity = gw.identity
    if identity.required:
        ok, _ = identity.authenticate(req.header_dict())
        if not ok:
            return resp.send_error(401, "Missing or invalid API key.", type="AuthenticationError")
    global _last_path, _last_chat
    if path is _last_path:  # the scanner shares a path's text while it repeats
        chat = _last_chat
    else:
        chat = _PROXY_ROUTES.get(path)
        _last_path, _last_chat = path, chat
    if chat is not None:
        if not str_eq(req.method, _POST):
            return resp.send_error(405, f"Use POST for {path}.")
        return proxy(gw, req, resp, path, chat)
    return gw.app._route(req, resp)


cdef list _names_seen = None
cdef str _default_seen = None


cpdef str band_for(list names, raw, tenant):
    """The band a request asks for (header, then body; ``names`` highest first), capped by
    its tenant's max_band. A number is vLLM's priority: lower is higher."""
    cdef str band
    global _names_seen, _default_seen
    if raw is None or raw == "":
        # The default band of the last names list seen (the gateway replaces its list
        # on a reload, never changes it in place): no search of the list each time.
        if names is _names_seen and names is not None:
            band = _default_seen
        else:
            band = "normal" if "normal" in names else names[len(names) // 2]
            _names_seen, _default_seen = names, band
    elif isinstance(raw, int) and not isinstance(raw, bool):
        band = names[min(max(raw, 0), len(names) - 1)]
    else:
        band = str(raw).strip().lower()
        if band not in names:
            raise BadRequest(f"Unknown priority band {raw!r}; bands are {names}.", "priority")
    if tenant is not None:
        cap = tenant.max_band
        if cap is not None and names.index(band) < names.index(cap):
            band = cap
    return band


cpdef proxy(Ingress gw, Request req, Responder resp, str route, bint chat):
    """Gateway.handle's /v1/chat/completions and /v1/completions: validate, place in a band
    and a pool, then an Exchange takes it from admission to the answer."""
    cdef Ticket ticket
    cdef PyObject* f[P_FIELDS]  # the request's fields, read at once (borrowed: r holds them)
    cdef bint compact  # the decoder left messages and prompt as compact JSON text
    cdef long limit
    cdef Identity identity = gw.identity
    cdef dict h = None
    # The gateway's own headers, looked up only when the request has any (most have none).
    rid = tenant_h = prio = sla = None
    if req.gateway_headers or identity.required:
        h = req.header_dict()
    if req.gateway_headers:
        rid = h.get("x-request-id")
        tenant_h = h.get("x-velocity-tenant")
        prio = h.get("x-velocity-priority")
        sla = h.get("x-velocity-sla-ms")
    if not rid:
        rid = new_request_id()
    band = "-"
    try:
        r = decode_fields(req.body, chat, f, &compact)  # a ProxyRequest, its fields left in f
        bound = identity.authenticate(h)[1] if identity.required else None
        tenant_name = identity.tenant_name(bound, tenant_h, <object>f[P_USER])  # tenant_for, without a tuple
        tenant = identity.tenant_named(bound, tenant_name)
        if prio is None:
            prio = <object>f[P_PRIORITY]
            if prio is _UNSET:  # not in the body
                prio = None
        band = band_for(gw.band_names, prio, tenant)
        sla_ms = <object>f[P_SLA_MS]
        if sla_ms is _UNSET:
            sla_ms = None
        if sla is not None:
            sla_ms = gw.app._sla_for(sla, sla_ms)
        if sla_ms is None and tenant is not None:
            sla_ms = (<Tenant>tenant).sla_ms  # the tenant's SLA, else (None) the server's
        model = <object>f[P_MODEL] or gw.default_model
        if type(model) is str:
            # The last model named, as one object: its hash is kept, so the look-ups by
            # model below (routing, pool, admission) do not hash a new string each time.
            if str_eq(model, gw._last_model):
                model = gw._last_model
            else:
                gw._last_model = model
        info = (<Router?>gw.router)._route_info(model, r, h if req.gateway_headers else None, compact)
    except (BadRequest, UnknownProfile) as e:
        count_request(gw, route, 400, band)
        return resp.send_error(400, str(e), param=e.param, headers=_rid_headers(rid))
    except RecursionError:  # prefix routing decoding messages nested past its depth
        e = too_deep()
        count_request(gw, route, 400, band)
        return resp.send_error(400, str(e), headers=_rid_headers(rid))
    pool = gw.pools.get(model) if model else None
    if pool is None:
        count_request(gw, route, 404, band)
        return resp.send_error(404, f"The model `{model}` does not exist.", type="NotFoundError",
                               param="model", headers=_rid_headers(rid))
    asked = <object>f[P_MAX_COMPLETION_TOKENS] or <object>f[P_MAX_TOKENS]
    if asked is not None and type(pool) is Pool:
        # As vLLM answers: a completion that cannot fit the engines' context beside even a
        # one-token prompt is a 400 here, not a request admission would queue and charge.
        # (asked: at most MAX_TOKENS_LIMIT, checked when the body was decoded.)
        limit = (<Pool>pool).context_length(gw.max_model_len)
        if <long>asked >= limit:
            count_request(gw, route, 400, band)
            return resp.send_error(400, context_error(limit, asked),
                                   param="max_completion_tokens" if <object>f[P_MAX_COMPLETION_TOKENS]
                                   else "max_tokens", headers=_rid_headers(rid))
    if tenant is not None:
        wait = (<Tenant?>tenant).take()
        if wait:
            return gw.app._reject(resp, route, 429, "rate-limit",
                              f"Tenant {tenant_name!r} is over its request rate.", band,
                              _rid_headers(rid), wait)
    body = strip_own_fields(req.body, r)
    max_tokens = <object>f[P_MAX_COMPLETION_TOKENS] or <object>f[P_MAX_TOKENS] or 256
    ticket = Ticket.__new__(Ticket)  # the fields are already what Ticket() would make of them
    ticket.band = band
    ticket.tenant = tenant_name
    ticket.sla_ms = sla_ms
    ticket.max_tokens = max_tokens
    ticket.prompt_bytes = len(body)
    ticket.model = model
    # No task: admission, the engine connection and the client meet in callbacks,
    # a stream's events included.
    _exchange(gw, req, resp, route, pool, ticket, info, body, rid).start()


cdef count_request(Ingress gw, str route, int status, str band):
    """velocity_requests_total{route, status, band} += 1: the child held by the metric for
    these very values, found without a call (the metric makes it on first use)."""
    if route is gw._last_route and band is gw._last_band and status == gw._last_status:
        # the same as the last request's (shared strs): its child again, no tuple to make
        # (the metric never drops a child of this family: its labels name no endpoint)
        gw._last_count.value += 1.0
        return
    metric = gw._requests_metric
    if metric is None:  # the gateway's metrics are made once, with it
        metric = gw._requests_metric = gw.metrics.requests
    child = (<dict>metric._by_raw).get((route, status, band))
    if type(child) is Value:
        (<Value>child).value += 1.0
        gw._last_route, gw._last_band, gw._last_status, gw._last_count = route, band, status, child
    else:
        metric.labels(route, status, band).inc()


cpdef settle(Ingress gw, str route, str band, Endpoint ep, Lease lease, int status, bint engine_failed, bint ok, error_text,
             long events):
    """The books of one relayed answer: endpoint health, the lease's outcome, the request count."""
    if status >= 500 or engine_failed:
        gw.monitor.passive_failure(ep, connect=False)
        ep.errors += 1
    elif ep.failures:  # a success resets the failures counted (there is nothing else to do)
        gw.monitor.passive_success(ep)
    ep.served += 1
    lease.release("completed" if ok else "failed", error_text, events)
    count_request(gw, route, status, band)


cdef Exchange _exchange(Ingress gw, Request req, Responder resp, str route, pool, Ticket ticket, RouteInfo info, bytes body,
                        str rid):
    """A new Exchange, made without an __init__ call. Fields not set here start as None,
    0 or False: no lease, endpoint, engine connection or drain task yet; a streamed
    answer's fields (relaying, ct, status, events, first, engine_failed, error_text) are
    set in upstream_head when it begins, and only read after."""
    cdef Exchange x = Exchange.__new__(Exchange)
    x.gw = gw
    x.loop = gw._loop
    x.req = req
    x.resp = resp
    x.route = route
    x.pool = pool
    x.ticket = ticket
    x.info = info
    x.body = body
    x.rid = rid
    x.state = _ADMITTING
    x.adm = gw.admission  # a reload may replace the gateway's: the queue is this one's
    x.tried = None  # the endpoints that failed it, once one has
    x.up_path = req.path
    x.reshape = None
    return x


cpdef start_native(Ingress gw, Request req, Responder resp, pool, Ticket ticket, RouteInfo info, bytes body,
                   str rid, reshape):
    """/generate on the same path as the OpenAI routes: its body (already a completions
    request) goes to the engine's /v1/completions, and ``reshape(exchange, body)`` turns
    a whole 2xx JSON answer into the native one (None: the engine's body was not what a
    completion looks like, a 502). Streams and errors go on as the engine sent them."""
    cdef Exchange x = _exchange(gw, req, resp, "/generate", pool, ticket, info, body, rid)
    x.up_path = "/v1/completions"
    x.reshape = reshape
    x.start()


# No @cython.freelist: Cython keeps one only for a base class, and Exchange extends Listener
# (it ignored the decorator here, with a warning at every build).
cdef class Exchange(Listener):
    """See the module doc. The engine connection's listener (called as C), and admission's
    waiter while queued (registered below with ``set_waiter``: the dispatch cycle calls
    ``waiting`` and ``granted`` as C)."""

    cpdef start(self):
        self.resp.add_disconnect_callback(self)  # itself, callable: no bound method to make
        try:
            got = self.adm._admit(self.ticket, self)
        except Rejected as e:
            self._end()
            self.gw.app._reject(self.resp, self.route, e.status, e.reason, e.message, self.ticket.band,
                            self.base_headers(), e.retry_after, from_admission=True)
            return
        if type(got) is Item:
            self.qitem = <Item>got
            if self.state == _ADMITTING:  # not granted within admit_nowait's own dispatch
                self.state = _QUEUED
            return
        try:  # as _granted: a failure ends the lease it holds
            self._admitted(got)
        except Exception:
            self._crashed()

    # -- admission's waiter: called from its dispatch cycle, so the work is scheduled --
    cdef bint waiting(self) except -1:
        return self.state == _QUEUED or self.state == _ADMITTING

    cdef void granted(self, Lease lease) except *:
        cdef Ingress gw = self.gw
        self.state = _ADMITTED
        self.lease = lease
        self.qitem = None  # the queue's item refers to this exchange: no cycle left behind
        # The grants of one pass run together, from one callback: no handle per request.
        if gw._grants is None:
            gw._grants = []
        gw._grants.append(self)
        if len(gw._grants) == 1:
            self.loop.call_soon(_run_grants, gw)

    def done(self):
        return not self.waiting()

    def set_result(self, lease):
        self.granted(lease)

    def set_exception(self, exc):
        self.state = _DONE
        self.qitem = None
        self.loop.call_soon(self._refused, exc)

    cdef _granted(self):
        lease = self.lease
        if self.abandoned:
            lease.release("cancelled")
            return
        try:  # as _guard does
            self._admitted(lease)
        except Exception:
            self._crashed()

    def _refused(self, e):
        if self.abandoned:
            return
        self._end()
        self.gw.app._reject(self.resp, self.route, e.status, e.reason, e.message, self.ticket.band, self.base_headers(),
                        e.retry_after, from_admission=True)

    # -- the engine ----------------------------------------------------------------------
    cdef _admitted(self, Lease lease):
        self.state = _ADMITTED
        self.lease = lease
        self.queue_s = monotonic() - self.req.received_at
        self._dispatch()

    cdef _dispatch(self):
        cdef UpstreamPool up
        cdef Lease lease = self.lease
        cdef Router router
        cdef Endpoint ep
        gw, tried = self.gw, self.tried
        router = gw.router
        # The lease's own band first, then any endpoint with room (the pool had headroom).
        ep = (router._pick(self.pool, self.info, lease, tried)  # the lease's fits(), as C
              or router._pick(self.pool, self.info, gw.admission.has_room, tried))
        if ep is None:
            self._fail_lease(None)
            if tried:
                return self._refuse(502, "upstream", "The engine failed before answering and no other engine "
                                                     "could take the request.")
            return self._refuse(503, "no-endpoint", f"No healthy engine for model `{self.pool.model}`.", 1.0)
        lease.rebind(ep)
        self.ep = ep
        up = ep.upstream
        # The bytes request_head would build (same headers, same order), in one step.
        key = ep.api_key
        auth = f"authorization: Bearer {key}\r\n".encode("latin-1") if key else b""
        up.request(_engine_request(up.json_post_head(self.up_path), self.rid, auth, self.body), self)

    # -- the engine connection's listener: called as C (upstream.pyx's Listener); the
    # Python names are for a connection made by the pool's Python (a fresh connect) --
    def upstream_sent(self, UpstreamConnection conn):
        self.on_sent(conn)

    def upstream_head(self, UpstreamConnection conn):
        self.on_head(conn)

    def upstream_body(self, UpstreamConnection conn, bytes data):
        self.on_body(conn, data)

    def upstream_raw(self, UpstreamConnection conn, bytes framed):
        self.on_raw(conn, framed)

    def upstream_done(self, UpstreamConnection conn):
        self.on_done(conn)

    def upstream_error(self, conn, err):
        self.on_error(conn, err)

    cdef on_sent(self, UpstreamConnection conn):
        self.conn = conn

    cdef on_body(self, UpstreamConnection conn, bytes data):
        self._relay(conn, data, False)

    cdef on_raw(self, UpstreamConnection conn, bytes framed):
        self._relay(conn, framed, True)

    cdef on_head(self, UpstreamConnection conn):
        self.headed = True
        (<Router?>self.gw.router)._on_dispatch(self.ep, self.info)
        if conn.status < 200 or conn.status > 599:
            return  # not an answer to relay: _answer makes it a 502 once the engine is done
        ct = _content_type(conn)
        if starts(ct, "text/event-stream") or (
                not conn.has_length and conn.te_chunked and not starts(ct, "application/json")):
            # A stream: its pieces come to upstream_body as they arrive (relay.py's rules).
            self.relaying = True
            self.ct = ct
            self.status = conn.status
            self.events = 0
            self.first = True
            self.engine_failed = False
            self.error_text = None
            self.resp.start(conn.status, content_type=ct, headers=self.out_headers())
            # An HTTP/1.1 client: the engine's chunks go on as they came (UpstreamConnection).
            self.raw_chunks = self.resp.chunked

    cdef _relay(self, UpstreamConnection conn, bytes data, bint framed):
        """A piece of a stream: its data (framed: whole chunks, framing and all) to the client."""
        cdef Py_ssize_t err_at
        resp = self.resp
        if self.first:
            self.first = False
            self.lease.first_byte()
        # (chunk framing is hex digits and CRLFs: it never holds an event's bytes)
        self.events += _events(data, &err_at)
        if err_at >= 0 and not self.engine_failed:  # the engine's own error event (e.g. out of memory)
            self.engine_failed = True
            self.error_text = data[err_at:err_at + 2000].decode("utf-8", "replace")
        if framed:
            resp.write_chunks(data)
        else:
            resp.write_nowait(data)
        if resp._proto._write_paused and self.task is None:
            conn.pause()  # the client reads slowly: so do we, from the engine
            self.task = task = self.loop.create_task(resp.write(b""))
            task.add_done_callback(self._drained)

    def _drained(self, task):
        self.task = None
        if task.cancelled() or task.exception() is not None:
            return  # the client left: on_disconnect has ended the rest
        conn = self.conn
        if conn is not None:
            conn.resume()

    cdef on_done(self, UpstreamConnection conn):
        try:
            if self.relaying:
                self._stream_done(conn)
            else:
                self._answer(conn)
        except Exception:
            self._crashed()

    cdef _stream_done(self, UpstreamConnection conn):
        cdef Endpoint ep = self.ep
        self.resp.end()
        (<UpstreamPool?>ep.upstream).release(conn)
        self.conn = None
        self._end()
        status = self.status
        ok = 200 <= status < 300 and not self.engine_failed
        error_text = self.error_text
        if not ok and error_text is None and status >= 400:
            error_text = f"engine status {status}"
        settle(self.gw, self.route, self.ticket.band, ep, self.lease, status, self.engine_failed, ok, error_text,
                        self.events)

    cdef _stream_failed(self, e):
        """The engine broke a stream: vLLM's error event and [DONE] when it is SSE, then the end."""
        self.conn = None
        self._end()
        resp = self.resp
        if starts(self.ct, "text/event-stream"):
            resp.write_nowait(stream_error_event(f"The engine failed during streaming: {e}", 500))
        resp.end()
        settle(self.gw, self.route, self.ticket.band, self.ep, self.lease, self.status, True, False, str(e),
                        self.events)

    cdef _answer(self, UpstreamConnection conn):
        cdef Endpoint ep = self.ep
        resp = self.resp
        if conn.status < 200 or conn.status > 599:  # (the C int: no Python comparison)
            return self._invalid_status(conn, conn.status)
        status = conn.status
        ct = _content_type(conn)
        body = conn.take()
        (<UpstreamPool?>ep.upstream).release(conn)
        self.conn = None
        self._end()
        ok = 200 <= status < 300
        error_text = None
        if not ok and status >= 400:
            error_text = body[:2000].decode("utf-8", "replace") if body else f"engine status {status}"
        if self.reshape is not None and ok and starts(ct, "application/json"):
            native = self.reshape(self, body)
            if native is None:
                settle(self.gw, self.route, self.ticket.band, ep, self.lease, 502, True, False,
                       "engine answered with an unexpected body", 0)
                return resp.send_error(502, "The engine answered with an unexpected body.",
                                       headers=self.out_headers())
            body = native
        settle(self.gw, self.route, self.ticket.band, ep, self.lease, status, False, ok, error_text, 0)
        resp._send(status, body, ct, self._out_lines())

    cdef _invalid_status(self, UpstreamConnection conn, int status):
        """An engine status that is no final HTTP answer (1xx, or past 599): a 502, the
        engine's failure; its connection is not reused."""
        cdef Endpoint ep = self.ep
        conn.abort()
        self.conn = None
        self.gw.monitor.passive_failure(ep, connect=False)
        ep.errors += 1
        self._fail_lease(f"engine status {status}")
        self._refuse(502, "upstream", f"The engine answered with an invalid HTTP status ({status}).")

    cdef on_error(self, UpstreamConnection conn, err):
        if self.abandoned or self.state == _DONE:
            return
        try:  # a bug in it fails this request (500), not the connection it was called from
            self._engine_failed(err)
        except Exception:
            self._crashed()

    cdef _engine_failed(self, e):
        if self.relaying:
            return self._stream_failed(e)
        gw, ep = self.gw, self.ep
        self.conn = None
        if self.headed:  # the engine broke its answer
            self._fail_lease(str(e))
            return self._refuse(502, "upstream", f"The engine failed while answering: {e}")
        gw.metrics.upstream_errors.labels(ep.name, "connect" if e.connect else "reset").inc()
        gw.monitor.passive_failure(ep, connect=True)
        if self.tried is None:
            self.tried = [ep]
        else:
            self.tried.append(ep)
        if not e.received and len(self.tried) < 2:
            return self._dispatch()  # nothing reached the client: once more on another endpoint
        self._fail_lease(str(e))
        self._refuse(502, "upstream", f"The engine failed before answering: {e}")

    # -- endings -------------------------------------------------------------------------
    def __call__(self):
        """The client's disconnect callback (the Responder calls it once, as on_disconnect)."""
        self.on_disconnect()

    def on_disconnect(self):
        """The client left: out of the queue, or the engine request aborted and the lease cancelled."""
        self.abandoned = True
        if self.state == _QUEUED:
            self.state = _DONE
            self.adm._withdraw(self.ticket, self.qitem)
            return
        self.state = _DONE
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
        if self.task is not None:
            self.task.cancel()
        if self.lease is not None:
            self.lease.release("cancelled")

    cpdef list base_headers(self):
        """The headers of every answer to this request, an error's too (made when needed)."""
        return _rid_headers(self.rid)

    def out_headers(self):
        return self.base_headers() + [("x-velocity-endpoint", self.ep.name),
                                    ("x-velocity-queue-ms", tenths(self.queue_s * 1000.0).decode("ascii")),
                                    ("x-velocity-band", self.ticket.band)]

    cdef bytes _out_lines(self):
        """out_headers() as encoded lines, in one step: copied into one bytes object when
        every value is stored a byte per character (the rule), else joined."""
        cdef str rid = self.rid, name = self.ep.name, band = self.ticket.band
        cdef char num[24]
        cdef int nlen = put_tenths(num, self.queue_s * 1000.0)
        cdef bytes out
        cdef char* p
        if nlen < 0 or not (latin1(rid) and latin1(name) and latin1(band)):
            return b"".join((_H_RID, rid.encode("latin-1"), _H_EP, name.encode("latin-1"), _H_QMS,
                             tenths(self.queue_s * 1000.0), _H_BAND, band.encode("latin-1"), b"\r\n"))
        out = PyBytes_FromStringAndSize(NULL, len(_H_RID) + len(rid) + len(_H_EP) + len(name) + len(_H_QMS)
                                        + nlen + len(_H_BAND) + len(band) + 2)
        p = PyBytes_AS_STRING(out)
        p = put(put_bytes(p, _H_RID), rid)
        p = put(put_bytes(p, _H_EP), name)
        p = put_bytes(p, _H_QMS)
        memcpy(p, num, nlen)
        p = put(put_bytes(p + nlen, _H_BAND), band)
        p[0] = 13
        p[1] = 10
        return out

    cdef _end(self):
        self.state = _DONE
        # The Responder (and a queue item) refer to this exchange until then: no cycle
        # left for the collector.
        self.resp.remove_disconnect_callback(self)
        self.qitem = None

    cdef _fail_lease(self, error_text):
        if self.lease is not None:
            self.lease.release("failed", error_text=error_text)

    cdef _refuse(self, int status, str reason, str message, retry_after=None):
        self._end()
        if not self.resp.started:
            self.gw.app._reject(self.resp, self.route, status, reason, message, self.ticket.band, self.base_headers(),
                            retry_after)

    cdef _crashed(self):
        """A step of this exchange raised (called in the except clause): the engine
        request and the lease end, then internal_error answers, logs and counts."""
        try:
            if self.conn is not None:
                self.conn.abort()
                self.conn = None
            self._fail_lease("gateway error")
            self._end()
        finally:
            internal_error(self.gw, self.req, self.resp, self.rid, self.route,
                           self.ticket.band if self.ticket is not None else "-", None)


cdef bint _x_waiting(object x) except -1:
    return (<Exchange>x).waiting()


cdef void _x_granted(object x, Lease lease) except *:
    (<Exchange>x).granted(lease)


set_waiter(Exchange, _x_waiting, _x_granted)
