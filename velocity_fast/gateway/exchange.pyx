"""One proxied request driven by callbacks, without a task, compiled.

Admission grants at once or later (the exchange is the queue's waiter), the request
goes out on a pooled engine connection, and the engine's answer is sent on from its
parser callbacks: a whole answer from the last one, a stream event by event as each
piece arrives (reading from the engine pauses while the client's buffer is full).

Every proxied route takes it: the OpenAI routes as they are, /generate with its answer
reshaped (``start_native``). A connect failure is retried once elsewhere. Every admitted
request ends its lease exactly once, a client that leaves included ("cancelled", engine
connection aborted). The Gateway supplies the shared parts: router, admission, monitor,
metrics and reject.
"""

import logging
import os

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeASCII
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy

from velocity_fast.admission.bands cimport set_locality
from velocity_fast.admission.controller cimport Admission, Lease, Ticket, set_waiter
from velocity_fast.metrics.values cimport Value
from velocity_fast.gateway.requests cimport (P_FIELDS, P_MAX_COMPLETION_TOKENS, P_MAX_TOKENS, P_MODEL, P_PRIORITY,
                                           P_SLA_MS, P_STREAM, P_STREAM_OPTIONS, P_USER, ask_usage, decode_fields,
                                           strip_own_fields)
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.routing.router cimport Router
from velocity_fast.server.connection cimport Responder
from velocity_fast.upstream.pool cimport UpstreamPool
from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection

from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.fleet.endpoint cimport Endpoint, Pool
from velocity_fast.gateway.identity cimport Identity, Tenant, tenant_by_header, tenant_draw_tokens, tenant_settle_tokens
from velocity_fast.http.message cimport OWN_PRIORITY, OWN_PROFILE, OWN_RID, OWN_SESSION, OWN_SLA, OWN_TENANT, Request
from velocity_fast.lowlevel.fmt cimport (cat, dec, digits_before, memmem, latin1, put, put_bytes, put_tenths, starts, str_eq,
                                      tenths)

import msgspec

from velocity_fast.admission.errors import Rejected
from velocity_fast.gateway.errors import BadRequest, context_error
from velocity_fast.gateway.requests import too_deep
from velocity_fast.routing.errors import UnknownProfile
from velocity_fast.routing.settings import PROFILE_HEADER, SESSION_HEADER
from velocity_fast.http.errors import stream_error_event

log = logging.getLogger("velocity.gateway")

cdef object _UNSET = msgspec.UNSET  # ProxyRequest's priority and sla_ms when the body has none
cdef str _JSON = intern("application/json")  # one object with server/connection.pyx's: its head needs no look-up
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
    cdef int nd = digits_before(digits + 24, <unsigned long long>n)
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


cdef long _events(bytes data, Py_ssize_t* err_at, bint* done):
    """How many SSE events begin in ``data`` (``data: `` lines), in one pass that also
    finds the first of them that is an error event (``data: {"error"``): its offset in
    ``err_at``, else -1; ``done`` is set when one is the stream's last, ``data: [DONE]``.
    ``data.count`` would be a method call per piece."""
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
        if n - pos >= 12 and hit[6] == c'[' and memcmp(hit + 6, b"[DONE]", 6) == 0:
            done[0] = True
        elif err_at[0] < 0 and n - pos >= 14 and memcmp(hit + 6, b'{"error"', 8) == 0:
            err_at[0] = pos
        pos += 6


# -- the engine's usage: read from the last bytes of an answer, in one pass, in C ---------

cdef extern from "string.h":
    void* memrchr(const void* s, int c, size_t n) nogil


cdef inline bint _key_is(const char* k, Py_ssize_t n, const char* name, Py_ssize_t m) noexcept:
    return n == m and memcmp(k, name, m) == 0


cdef long long _NUMBER_MAX = 1000000000000000  # (a C constant: a literal this long is compared as a Python int)


cdef inline const char* _number(const char* p, const char* end, long long* v) noexcept:
    """The digits at ``p`` into ``v``; the byte after them, or NULL when there are none."""
    cdef long long n = 0
    cdef const char* start = p
    while p < end and p[0] >= c'0' and p[0] <= c'9' and n < _NUMBER_MAX:
        n = n * 10 + (p[0] - c'0')
        p += 1
    v[0] = n
    return p if p > start else NULL


cdef inline bint _same(const char* a, const char* b, Py_ssize_t n) noexcept:
    """a[:n] == b[:n] for n >= 8, eight bytes at a time (the last eight overlapping the
    ones before): inlined where n is a constant, no memcmp call; up to 24 bytes, the
    words' differences or-ed, one branch."""
    cdef uint64_t x, y, d
    cdef Py_ssize_t i = 0
    if n <= 24:
        memcpy(&x, a, 8)
        memcpy(&y, b, 8)
        d = x ^ y
        memcpy(&x, a + n - 8, 8)
        memcpy(&y, b + n - 8, 8)
        d |= x ^ y
        if n > 16:
            memcpy(&x, a + 8, 8)
            memcpy(&y, b + 8, 8)
            d |= x ^ y
        return d == 0
    while i + 8 < n:
        memcpy(&x, a + i, 8)
        memcpy(&y, b + i, 8)
        if x != y:
            return False
        i += 8
    memcpy(&x, a + n - 8, 8)
    memcpy(&y, b + n - 8, 8)
    return x == y


cdef inline const char* _member(const char* p, const char* end, const char* key, Py_ssize_t klen,
                                long long* v) noexcept:
    """``key`` (with its quotes, colon and the comma before it) then a number at ``p``."""
    if end - p <= klen or not _same(p, key, klen):
        return NULL
    return _number(p + klen, end, v)


cdef bint _read_usage(const char* s, const char* end, long long* out) noexcept:
    """The usage object that opens at ``s`` (its ``{``): its prompt, cached (0 when not
    reported) and completion tokens into ``out[3]``. vLLM writes it compact and in one
    order, read as such; anything else is walked (_walk_usage)."""
    cdef const char* p = s
    cdef long long total
    p = _member(p, end, b'{"prompt_tokens":', 17, &out[0])
    if p != NULL:
        p = _member(p, end, b',"total_tokens":', 16, &total)
    if p != NULL:
        p = _member(p, end, b',"completion_tokens":', 21, &out[2])
    if p != NULL and p < end:
        if p[0] == c'}':
            out[1] = 0
            return True
        if _member(p, end, b',"prompt_tokens_details":{"cached_tokens":', 41, &out[1]) != NULL:
            return True
    return _walk_usage(s, end, out)


cdef bint _walk_usage(const char* s, const char* end, long long* out) noexcept:
    """The usage object that opens at ``s`` (its ``{``), walked once: its prompt, cached (0
    when not reported) and completion tokens into ``out[3]``. False when it does not
    close before ``end`` or lacks the counts. Its members are numbers and objects of
    numbers (prompt_tokens_details): no string value to skip."""
    cdef int depth = 0
    cdef const char* p = s
    cdef const char* k
    cdef Py_ssize_t klen
    cdef long long v
    cdef char c
    out[0] = out[2] = -1
    out[1] = 0
    while p < end:
        c = p[0]
        if c == c'{':
            depth += 1
        elif c == c'}':
            depth -= 1
            if depth == 0:
                return out[0] >= 0 and out[2] >= 0
        elif c == c'"':
            k = p + 1
            p = k
            while p < end and p[0] != c'"':
                p += 1
            klen = p - k
            p += 1
            while p < end and (p[0] == c' ' or p[0] == c':'):
                p += 1
            if p < end and p[0] >= c'0' and p[0] <= c'9':
                v = 0
                while p < end and p[0] >= c'0' and p[0] <= c'9' and v < _NUMBER_MAX:
                    v = v * 10 + (p[0] - c'0')
                    p += 1
                if _key_is(k, klen, b"prompt_tokens", 13):
                    out[0] = v
                elif _key_is(k, klen, b"completion_tokens", 17):
                    out[2] = v
                elif _key_is(k, klen, b"cached_tokens", 13):
                    out[1] = v
            continue
        p += 1
    return False


# vLLM ends a whole answer with its usage and a few members of null: it is in this tail.
cdef Py_ssize_t _USAGE_TAIL = 2048


cdef const char* _usage_back(const char* low, const char* e) noexcept:
    """The last ``"usage":`` in [low, e): the byte after it, or NULL. Found by its 'g' from
    the end (memrchr): no key of a usage object has one, and what vLLM writes after it
    few (prompt_logprobs)."""
    cdef const char* p
    while e > low:
        p = <const char*>memrchr(low, c'g', e - low)
        if p == NULL:
            return NULL
        if p - low >= 4 and _same(p - 4, b'"usage":', 8):
            return p + 4
        e = p
    return NULL


cdef bint _body_usage(bytes body, long long* out) noexcept:
    """A whole answer's usage (the last ``"usage":{`` of its tail) into ``out[3]``."""
    cdef const char* s = PyBytes_AS_STRING(body)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef const char* end = s + n
    cdef const char* p = _usage_back(s + (n - _USAGE_TAIL if n > _USAGE_TAIL else 0), end)
    if p == NULL:
        return False
    while p < end and p[0] == c' ':
        p += 1
    return p < end and p[0] == c'{' and _read_usage(p, end, out)


def body_usage(bytes body):
    """(prompt, cached, completion) tokens of a whole answer's usage, or None (tests)."""
    cdef long long u[3]
    return (u[0], u[1], u[2]) if _body_usage(body, u) else None


# A stream's final usage chunk, as vLLM (and the sim) write it: no choices, then usage.
cdef const char* _USAGE_EVENT = b'"choices":[],"usage":{'
cdef Py_ssize_t _USAGE_EVENT_LEN = 22


cdef inline bint _hex_digit(char c) noexcept:
    return (c'0' <= c <= c'9') or (c'a' <= c <= c'f') or (c'A' <= c <= c'F')


cdef Py_ssize_t _usage_at(const char* s, Py_ssize_t n, bint framed) noexcept:
    """Where a stream's final usage chunk begins its ``"choices":[],"usage":{`` in a
    piece, or -1. Only the piece's last event is looked at, or the one before a closing
    [DONE] (vLLM sends usage last): and only when it ends as a usage chunk does, with two
    closing braces (a token's chunk ends with its choices, ``]}``). ``framed``: whole
    HTTP chunks, framing and all."""
    cdef Py_ssize_t e = n
    cdef const char* p
    if framed and e >= 2 and s[e - 2] == c'\r':
        e -= 2
    if e >= 14 and memcmp(s + e - 14, b"data: [DONE]\n\n", 14) == 0:
        e -= 14
        if framed and e >= 2 and s[e - 2] == c'\r':  # the framing of [DONE]'s own chunk
            e -= 2
            while e > 0 and _hex_digit(s[e - 1]):
                e -= 1
            if e >= 2 and s[e - 1] == c'\n':
                e -= 2
    if e < 4 or memcmp(s + e - 4, b"}}\n\n", 4) != 0:
        return -1
    p = _usage_back(s + (e - 2048 if e > 2048 else 0), s + e)
    if p != NULL and p - s >= _USAGE_EVENT_LEN - 1 and memcmp(p - _USAGE_EVENT_LEN + 1, _USAGE_EVENT,
                                                              _USAGE_EVENT_LEN) == 0:
        return p - s - _USAGE_EVENT_LEN + 1
    return -1


cdef bytes _unframe(bytes framed):
    """The data of whole HTTP chunks (size line, data, CRLF each), joined."""
    cdef const char* s = PyBytes_AS_STRING(framed)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(framed), pos = 0, size, w = 0
    cdef int h
    cdef char* q
    out = PyBytes_FromStringAndSize(NULL, n)
    q = PyBytes_AS_STRING(out)
    while pos < n:
        size = 0
        while pos < n and s[pos] != c'\r':
            h = s[pos]
            if c'0' <= h <= c'9':
                size = size * 16 + h - c'0'
            elif c'a' <= h <= c'f':
                size = size * 16 + h - c'a' + 10
            elif c'A' <= h <= c'F':
                size = size * 16 + h - c'A' + 10
            else:  # an extension: skipped to the end of the line
                while pos < n and s[pos] != c'\r':
                    pos += 1
                break
            pos += 1
        pos += 2
        if size > n - pos:
            size = n - pos if n > pos else 0
        memcpy(q + w, s + pos, size)
        w += size
        pos += size + 2
    return out[:w]


cdef class Ingress:
    """What every proxied request reads of its gateway: C fields instead of instance-dict
    look-ups. A reload assigns new ones (admission, router, identity, band names); a
    request holds what it read when it arrived.

    ``app`` is the gateway above (gateway/app.py), called through a small interface for
    what is not the proxy path: ``health(resp)``, ``route_other(req, resp)`` (every other
    route), ``reject(resp, route, status, reason, message, band, headers, retry_after,
    from_admission=...)`` and ``sla_for(header, body_value)``."""

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
            resp.send_error(500, f"Internal server error (request {rid}).", headers=_rid_headers(rid))
        elif not answered:
            resp.abort()  # a stream that cannot be finished: the client sees it cut short


def _run_grants(Ingress ingress):
    """The exchanges granted a lease since the last run, in the order of their grants."""
    cdef Exchange x
    grants, ingress._grants = ingress._grants, []
    for x in grants:
        try:
            x._granted()
        except Exception:  # one exchange's failure must not strand the others
            log.exception("granted exchange failed")


def handle_client(Ingress ingress, Request req, Responder resp):
    """Gateway.handle, the client port's handler: /health, the key check (every path but
    /health), the proxy routes (arranged from callbacks); the rest is Gateway.route_other's."""
    cdef str path = req.path
    cdef Identity identity
    if str_eq(path, _HEALTH):
        return ingress.app.health(resp)
    identity = ingress.identity
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
        return proxy(ingress, req, resp, path, chat)
    return ingress.app.route_other(req, resp)


cdef list _names_seen = None
cdef str _default_seen = None


cpdef str band_for(list names, raw, tenant, str default=None):
    """The band a request asks for (header, then body; ``names`` highest first), capped by
    its tenant's max_band. A number is vLLM's priority: lower is higher. A request that
    names none gets ``default`` (admission.default_band); one that names a band that does
    not exist is a 400 naming the bands, not a silent default: the header and the body's
    string ``priority`` are this gateway's own, so an unknown name is a mistake to show."""
    cdef str band
    global _names_seen, _default_seen
    if raw is None or raw == "":
        if default is not None:
            band = default
        # Without one: "normal", else the middle band, of the last names list seen (the
        # gateway replaces its list on a reload, never changes it in place).
        elif names is _names_seen and names is not None:
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
        cap = (<Tenant>tenant).max_band if type(tenant) is Tenant else tenant.max_band
        if cap is not None and names.index(band) < names.index(cap):
            band = cap
    return band


cpdef proxy(Ingress ingress, Request req, Responder resp, str route, bint chat):
    """Gateway.handle's /v1/chat/completions and /v1/completions: validate, place in a band
    and a pool, then an Exchange takes it from admission to the answer."""
    cdef Ticket ticket
    cdef PyObject* f[P_FIELDS]  # the request's fields, read at once (borrowed: r holds them)
    cdef bint compact  # the decoder left messages and prompt as compact JSON text
    cdef long limit
    cdef Identity identity = ingress.identity
    cdef dict h = None
    cdef Tenant t
    cdef Exchange x
    cdef double q_est, wait, now
    cdef bint stream, strip, want
    cdef unsigned int own
    cdef const char* tenant_p = NULL  # the tenant header's bytes (in raw), when read where they lie
    cdef Py_ssize_t tenant_n = 0
    cdef Tenant known = None  # the tenant those bytes named before
    # The gateway's own headers, looked up only when the request has any (most have none):
    # read where the scanner found them, no dict (the router is given one only of what it
    # reads, when the request has any).
    rid = tenant_h = prio = sla = route_h = None
    if identity.required:  # the key's header too
        h = req.header_dict()
    if req.gateway_headers:
        if h is None and req.own_direct():
            own = req.own
            if own & (1u << OWN_RID):
                rid = req.own_text(OWN_RID)
            if own & (1u << OWN_TENANT):
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
            if h is None:
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
            bound = identity.authenticate(h)[1] if identity.required else None
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
        info = (<Router?>ingress.router).route_info(model, r, route_h, compact)
    except (BadRequest, UnknownProfile) as e:
        count_request(ingress, route, 400, band)
        return resp.send_error(400, str(e), param=e.param, headers=_rid_headers(rid))
    except RecursionError:  # prefix routing decoding messages nested past its depth
        e = too_deep()
        count_request(ingress, route, 400, band)
        return resp.send_error(400, str(e), headers=_rid_headers(rid))
    pool = ingress.pools.get(model) if model else None
    if pool is None:
        count_request(ingress, route, 404, band)
        return resp.send_error(404, f"The model `{model}` does not exist.", type="NotFoundError",
                               param="model", headers=_rid_headers(rid))
    asked = <object>f[P_MAX_COMPLETION_TOKENS] or <object>f[P_MAX_TOKENS]
    if asked is not None and type(pool) is Pool:
        # As vLLM answers: a completion that cannot fit the engines' context beside even a
        # one-token prompt is a 400 here, not a request admission would queue and charge.
        # (asked: at most MAX_TOKENS_LIMIT, checked when the body was decoded.)
        limit = (<Pool>pool).context_length(ingress.max_model_len)
        if <long>asked >= limit:
            count_request(ingress, route, 400, band)
            return resp.send_error(400, context_error(limit, asked),
                                   param="max_completion_tokens" if <object>f[P_MAX_COMPLETION_TOKENS]
                                   else "max_tokens", headers=_rid_headers(rid))
    body = strip_own_fields(req.body, r)
    max_tokens = <object>f[P_MAX_COMPLETION_TOKENS] or <object>f[P_MAX_TOKENS] or 256
    q_est = 0.0
    if tenant is not None:
        t = <Tenant?>tenant
        if t.tpm is not None:  # its quota of tokens: the estimate must fit in what is left
            q_est = PyBytes_GET_SIZE(body) / _BYTES_PER_TOKEN + <long>max_tokens
            # Refilled to when the request was read (this pass's clock), no second read.
            now = req.received_at
            wait = tenant_draw_tokens(t, q_est, now if now > 0.0 else monotonic())
            if wait:
                _count_reject(t, "rate-limit")
                return ingress.app.reject(resp, route, 429, "rate-limit",
                                      f"Tenant {tenant_name!r} is over its tokens per minute.", band,
                                      _rid_headers(rid), wait)
        wait = t.take() if t.rate is not None else 0.0  # (no call for a tenant with no request rate)
        if wait:
            if q_est:
                tenant_settle_tokens(t, -q_est)
            _count_reject(t, "rate-limit")
            return ingress.app.reject(resp, route, 429, "rate-limit",
                              f"Tenant {tenant_name!r} is over its request rate.", band,
                              _rid_headers(rid), wait)
    stream = <object>f[P_STREAM] is True
    strip = False
    # Usage is read only where something settles from it: a configured tenant (its
    # quota, its figures) or token fairness on what was served.
    want = tenant is not None or (<Admission>ingress.admission).settle_usage
    if stream and want:
        options = <object>f[P_STREAM_OPTIONS]
        if options is None or not options.include_usage:
            # Asked of the engine for the settlement, cut from the client's stream.
            body = ask_usage(body, options is not None)
            strip = True
    ticket = Ticket.__new__(Ticket)  # the fields are already what Ticket() would make of them
    ticket.band = band
    ticket.tenant = tenant_name
    ticket.sla_ms = sla_ms
    ticket.max_tokens = max_tokens
    ticket.prompt_bytes = len(body)
    ticket.model = model
    x = _exchange(ingress, req, resp, route, pool, ticket, info, body, rid)
    x.tenant = tenant
    x.q_est = q_est
    x.prompt_est = <long long>(ticket.prompt_bytes / _BYTES_PER_TOKEN)
    x.stream_req = stream
    x.want_usage = want
    x.usage_strip = strip
    # No task: admission, the engine connection and the client meet in callbacks,
    # a stream's events included.
    x.start()


cdef double _BYTES_PER_TOKEN = 4.0  # the estimate of a prompt's tokens from its bytes (admission's)


cdef inline void _count_reject(Tenant t, str reason):
    """One more request of ``t`` declined for ``reason`` (its figures in /stats, /metrics)."""
    d = t.rejections
    d[reason] = d.get(reason, 0) + 1


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


cdef Exchange _exchange(Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket, RouteInfo info, bytes body,
                        str rid):
    """A new Exchange, made without an __init__ call. Fields not set here start as None,
    0 or False: no lease, endpoint, engine connection or drain task yet; a streamed
    answer's fields (relaying, ct, status, events, first, engine_failed, error_text) are
    set in on_head when it begins, and only read after."""
    cdef Exchange x = Exchange.__new__(Exchange)
    x.ingress = ingress
    x.loop = ingress._loop
    x.req = req
    x.resp = resp
    x.route = route
    x.pool = pool
    x.ticket = ticket
    x.info = info
    x.body = body
    x.rid = rid
    x.state = _ADMITTING
    x.adm = ingress.admission  # a reload may replace the gateway's: the queue is this one's
    x.tried = None  # the endpoints that failed it, once one has
    x.up_path = req.path
    x.reshape = None
    return x


cpdef start_native(Ingress ingress, Request req, Responder resp, pool, Ticket ticket, RouteInfo info, bytes body,
                   str rid, reshape, tenant=None, double q_est=0.0):
    """/generate on the same path as the OpenAI routes: its body (already a completions
    request) goes to the engine's /v1/completions, and ``reshape(exchange, body)`` turns
    a whole 2xx JSON answer into the native one (None: the engine's body was not what a
    completion looks like, a 502). Streams and errors go on as the engine sent them (the
    body asks a stream's usage itself: its chunk is relayed). ``tenant``: the configured
    tenant, ``q_est``: the tokens drawn from its quota (settled as the OpenAI routes')."""
    cdef Exchange x = _exchange(ingress, req, resp, "/generate", pool, ticket, info, body, rid)
    x.up_path = "/v1/completions"
    x.reshape = reshape
    x.tenant = tenant
    x.q_est = q_est
    x.prompt_est = <long long>(ticket.prompt_bytes / _BYTES_PER_TOKEN)
    x.stream_req = b'"stream":true' in body
    x.want_usage = tenant is not None or x.adm.settle_usage
    x.start()


# No @cython.freelist: Cython keeps one only for a base class, and Exchange extends ResponseHandler
# (it ignored the decorator here, with a warning at every build).
cdef class Exchange(ResponseHandler):
    """See the module doc. The engine connection's response handler (called as C), and admission's
    waiter while queued (registered below with ``set_waiter``: the dispatch cycle calls
    ``waiting`` and ``granted`` as C)."""

    cpdef start(self):
        self.resp.add_disconnect_callback(self)  # itself, callable: no bound method to make
        try:
            got = self.adm.admit_nowait(self.ticket, self)
        except Rejected as e:
            self._account(0, 0, 0, True)  # nothing served: the quota's draw comes back
            self._reject_counted(e.reason)
            self._end()
            self.ingress.app.reject(self.resp, self.route, e.status, e.reason, e.message, self.ticket.band,
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
        cdef Ingress ingress = self.ingress
        self.state = _ADMITTED
        self.lease = lease
        self.qitem = None  # the queue's item refers to this exchange: no cycle left behind
        # The grants of one pass run together, from one callback: no handle per request.
        if ingress._grants is None:
            ingress._grants = []
        ingress._grants.append(self)
        if len(ingress._grants) == 1:
            self.loop.call_soon(_run_grants, ingress)

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
        self._account(0, 0, 0, True)
        self._reject_counted(e.reason)
        self._end()
        self.ingress.app.reject(self.resp, self.route, e.status, e.reason, e.message, self.ticket.band, self.base_headers(),
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
        ingress, tried = self.ingress, self.tried
        router = ingress.router
        # The lease's own band first, then any endpoint with room (the pool had headroom).
        ep = (router.pick(self.pool, self.info, lease, tried)  # the lease's has_room, as C
              or router.pick(self.pool, self.info, ingress.admission.has_room, tried))
        if ep is None:
            self._account(0, 0, 0, True)  # no engine produced anything
            self._fail_lease(None)
            if tried:
                return self._refuse(502, "upstream", "The engine failed before answering and no other engine "
                                                     "could take the request.")
            return self._refuse(503, "no-endpoint", f"No healthy engine for model `{self.pool.model}`.", 1.0)
        if not lease.claim(ep):
            # Workers: another took the engine's last slot since the pick; the grant
            # reserved a lease within the pool's limits, so another has room.
            first = ep
            full = list(tried) if tried else []
            while ep is not None and not lease.claim(ep):
                full.append(ep)
                ep = router.pick(self.pool, self.info, ingress.admission.has_room, full)
            if ep is None:
                ep = first
                lease.force(ep)
        self.ep = ep
        up = ep.upstream
        # The bytes request_head would build (same headers, same order), in one step.
        key = ep.api_key
        auth = f"authorization: Bearer {key}\r\n".encode("latin-1") if key else b""
        up.request(_engine_request(up.json_post_head(self.up_path), self.rid, auth, self.body), self)

    # -- the engine connection's response handler: called as C (upstream/connection.pyx's
    # ResponseHandler) --
    cpdef on_sent(self, UpstreamConnection conn):
        self.conn = conn

    cpdef on_body(self, UpstreamConnection conn, bytes data):
        self._relay(conn, data, False)

    cpdef on_raw(self, UpstreamConnection conn, bytes framed):
        self._relay(conn, framed, True)

    cpdef on_head(self, UpstreamConnection conn):
        self.headed = True
        (<Router?>self.ingress.router).on_dispatch(self.ep, self.info)
        if conn.status < 200 or conn.status > 599:
            return  # not an answer to relay: _answer makes it a 502 once the engine is done
        ct = _content_type(conn)
        if starts(ct, "text/event-stream") or (
                not conn.has_length and conn.te_chunked and not starts(ct, "application/json")):
            # A stream: its pieces come to on_body as they arrive (upstream/connection.pyx relays each chunk as it is read).
            self.relaying = True
            self.ct = ct
            self.status = conn.status
            self.events = 0
            self.first = True
            self.engine_failed = False
            self.done_sent = False
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
        self.events += _events(data, &err_at, &self.done_sent)
        if err_at >= 0 and not self.engine_failed:  # the engine's own error event (e.g. out of memory)
            self.engine_failed = True
            self.error_text = data[err_at:err_at + 2000].decode("utf-8", "replace")
        if self.want_usage and not self.usage_seen and _usage_at(PyBytes_AS_STRING(data),
                                                                 PyBytes_GET_SIZE(data), framed) >= 0:
            if framed and self.usage_strip:  # the piece is cut: its data goes on as one chunk
                data = _unframe(data)
                framed = False
            data = self._usage_event(data, framed)
        if framed:
            resp.write_chunks(data)
        elif PyBytes_GET_SIZE(data):  # (an empty write would end the chunked stream)
            resp.write_nowait(data)
        if resp.proto.write_paused and self.task is None:
            conn.pause()  # the client reads slowly: so do we, from the engine
            self.task = task = self.loop.create_task(resp.write(b""))
            task.add_done_callback(self._drained)

    cdef bytes _usage_event(self, bytes data, bint framed):
        """The piece that holds the final usage chunk: its counts read; the chunk cut
        from the piece when the gateway asked for it and the client did not."""
        cdef const char* s = PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data), at, i
        cdef const char* end
        cdef long long u[3]
        at = _usage_at(s, n, framed)
        if at < 0 or not _read_usage(s + at + _USAGE_EVENT_LEN - 1, s + n, u):
            return data  # split across pieces: settled from the chunks relayed
        self.usage_seen = True
        self.u_prompt, self.u_cached, self.u_completion = u[0], u[1], u[2]
        if not self.usage_strip:
            return data
        # The event: from its "data: " to the blank line that ends it.
        i = at
        while i >= 0 and memcmp(s + i, b"data: ", 6) != 0:
            i -= 1
        end = <const char*>memmem(s + at, n - at, b"\n\n", 2)
        if i < 0 or end == NULL:
            return data
        self.events -= 1
        return data[:i] + data[end - s + 2:]

    def _drained(self, task):
        self.task = None
        if task.cancelled() or task.exception() is not None:
            return  # the client left: on_disconnect has ended the rest
        conn = self.conn
        if conn is not None:
            conn.resume()

    cpdef on_done(self, UpstreamConnection conn):
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
        self._account_stream()
        status = self.status
        ok = 200 <= status < 300 and not self.engine_failed
        error_text = self.error_text
        if not ok and error_text is None and status >= 400:
            error_text = f"engine status {status}"
        settle(self.ingress, self.route, self.ticket.band, ep, self.lease, status, self.engine_failed, ok, error_text,
                        self.events)

    cdef _stream_failed(self, e):
        """The engine broke a stream: vLLM's error event and [DONE] when it is SSE, then the end."""
        self.conn = None
        self._end()
        resp = self.resp
        if starts(self.ct, "text/event-stream"):
            resp.write_nowait(stream_error_event(f"The engine failed during streaming: {e}", 500))
        resp.end()
        self._account_stream()
        settle(self.ingress, self.route, self.ticket.band, self.ep, self.lease, self.status, True, False, str(e),
                        self.events)

    cdef _answer(self, UpstreamConnection conn):
        cdef Endpoint ep = self.ep
        cdef long long u[3]
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
        if not self.want_usage:
            pass
        elif not ok:
            self._account(0, 0, 0, True)  # an engine's error answer served no tokens
        elif _body_usage(body, u):
            self._account(u[0], u[1], u[2], True)
        else:
            self._account(0, 0, 0, False)  # no usage in the answer: the estimate stands
        if self.reshape is not None and ok and starts(ct, "application/json"):
            native = self.reshape(self, body)
            if native is None:
                settle(self.ingress, self.route, self.ticket.band, ep, self.lease, 502, True, False,
                       "engine answered with an unexpected body", 0)
                return resp.send_error(502, "The engine answered with an unexpected body.",
                                       headers=self.out_headers())
            body = native
        settle(self.ingress, self.route, self.ticket.band, ep, self.lease, status, False, ok, error_text, 0)
        resp.send(status, body, ct, self._out_lines())

    cdef _invalid_status(self, UpstreamConnection conn, int status):
        """An engine status that is no final HTTP answer (1xx, or past 599): a 502, the
        engine's failure; its connection is not reused."""
        cdef Endpoint ep = self.ep
        conn.abort()
        self.conn = None
        self.ingress.monitor.passive_failure(ep, connect=False)
        ep.errors += 1
        self._account(0, 0, 0, True)
        self._fail_lease(f"engine status {status}")
        self._refuse(502, "upstream", f"The engine answered with an invalid HTTP status ({status}).")

    cpdef on_error(self, UpstreamConnection conn, err):
        if self.abandoned or self.state == _DONE:
            return
        try:  # a bug in it fails this request (500), not the connection it was called from
            self._engine_failed(err)
        except Exception:
            self._crashed()

    cdef _engine_failed(self, e):
        if self.relaying:
            return self._stream_failed(e)
        ingress, ep = self.ingress, self.ep
        self.conn = None
        if self.headed:  # the engine broke its answer
            self._fail_lease(str(e))
            return self._refuse(502, "upstream", f"The engine failed while answering: {e}")
        ingress.metrics.upstream_errors.labels(ep.name, "connect" if e.connect else "reset").inc()
        ingress.monitor.passive_failure(ep, connect=True)
        if self.tried is None:
            self.tried = [ep]
        else:
            self.tried.append(ep)
        if not e.received and len(self.tried) < 2:
            return self._dispatch()  # nothing reached the client: once more on another endpoint
        self._account(0, 0, 0, True)  # the engine answered nothing
        self._fail_lease(str(e))
        self._refuse(502, "upstream", f"The engine failed before answering: {e}")

    # -- endings -------------------------------------------------------------------------
    def __call__(self):
        """The client's disconnect callback (the Responder calls it once, as on_disconnect)."""
        self.on_disconnect()

    def on_disconnect(self):
        """The client left: out of the queue, or the engine request aborted and the lease cancelled."""
        if self.resp.cut_short:
            return self._cut()
        if self.done_sent and self.state == _ADMITTED:
            return self._left_after_done()
        self.abandoned = True
        if self.state == _QUEUED:
            self.state = _DONE
            self.adm.withdraw(self.ticket, self.qitem)
            self._account(0, 0, 0, True)  # never served: the quota's draw comes back
            return
        if self.state != _DONE:
            # What the engine produced up to the abort: a stream's relayed chunks (its
            # usage, if it came); the prompt of a stream not yet answered; nothing if the
            # engine never had it. A whole answer's work is unknown: its estimate stands.
            if self.relaying:
                self._account_stream()
            elif self.ep is None:
                self._account(0, 0, 0, True)
            elif self.stream_req:
                self._account(self.prompt_est, 0, 0, True)
        self.state = _DONE
        self._drop_engine()
        if self.lease is not None:
            self.lease.release("cancelled")

    cdef void _drop_engine(self) except *:
        """The engine request ends here: its connection aborted (the engine aborts the
        sequence), the task that was connecting cancelled."""
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
        if self.task is not None:
            self.task.cancel()

    cdef _left_after_done(self):
        """The client left once the stream's ``data: [DONE]`` reached it, before the
        engine's end of the stream (its last, empty chunk, which vLLM and the sim engine
        write apart from [DONE]) came: the openai client closes its connection at [DONE].
        The client has the whole answer: the books are those of a stream that ended
        (completed, counted with its status), not a cancel. The engine connection, not at
        the end of its answer, cannot be reused: it is closed."""
        self.abandoned = True
        self.state = _DONE
        self.qitem = None
        self._drop_engine()
        status = self.status
        ok = 200 <= status < 300 and not self.engine_failed
        error_text = self.error_text
        if not ok and error_text is None and status >= 400:
            error_text = f"engine status {status}"
        settle(self.ingress, self.route, self.ticket.band, self.ep, self.lease, status, self.engine_failed, ok,
               error_text, self.events)

    cdef _cut(self):
        """The gateway's shutdown grace ran out first (Responder.cut, which then answers the
        client): out of the queue, or the engine request aborted and the lease failed; the
        request is counted with the status its client sees (its stream's, or 503)."""
        self.abandoned = True
        status = self.status if self.relaying else 503
        if self.state == _QUEUED:
            self.state = _DONE
            self.adm.withdraw(self.ticket, self.qitem)
        else:
            self.state = _DONE
            self._drop_engine()
            if self.lease is not None:
                self.lease.release("failed", "the gateway shut down", self.events)
        self.qitem = None
        count_request(self.ingress, self.route, status, self.ticket.band)

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
        self._account(0, 0, 0, False)  # (unless told before: the estimate stands)
        if self.lease is not None:
            self.lease.release("failed", error_text=error_text)

    cdef _account(self, long long prompt, long long cached, long long completion, bint known):
        """Once per request, before its lease ends: what the engine served (``known``;
        else the estimates drawn stand) settles the tenant's fairness counter and quota,
        and counts in its figures."""
        cdef Tenant t = self.tenant
        cdef Lease lease = self.lease
        cdef Admission adm
        cdef long long c
        if self.accounted:
            return
        self.accounted = True
        if not known or not self.want_usage:
            return
        if lease is not None and not lease.done:
            # Lease.usage, inline (no method call): the cost token fairness settles to
            c = cached if cached < prompt else prompt
            adm = self.adm  # (the lease's: it granted it)
            lease.fair_actual = <double>(prompt - c) + c * adm.cached_weight + completion * adm.output_weight
            lease.fair_known = True
        if t is not None:
            t.served_prompt += prompt
            t.served_cached += cached
            t.served_completion += completion
            if self.q_est:
                tenant_settle_tokens(t, prompt + completion - self.q_est)

    cdef _account_stream(self):
        """A stream's end: its usage chunk's counts, else the prompt estimated and a token
        for each chunk relayed."""
        if self.usage_seen:
            self._account(self.u_prompt, self.u_cached, self.u_completion, True)
        else:
            self._account(self.prompt_est, 0, self.events, True)

    cdef _reject_counted(self, str reason):
        if self.tenant is not None:
            _count_reject(self.tenant, reason)

    cdef _refuse(self, int status, str reason, str message, retry_after=None):
        self._end()
        if not self.resp.started:
            self.ingress.app.reject(self.resp, self.route, status, reason, message, self.ticket.band, self.base_headers(),
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
            internal_error(self.ingress, self.req, self.resp, self.rid, self.route,
                           self.ticket.band if self.ticket is not None else "-", None)


cdef bint _x_waiting(object x) except -1:
    return (<Exchange>x).waiting()


cdef void _x_granted(object x, Lease lease) except *:
    (<Exchange>x).granted(lease)


cdef double _x_locality(object x) except? -1.0:
    """Admission's locality fairness: how much of a queued request's prompt an engine
    with room holds (the router's prefix index). A waiter of another kind answers with
    its ``prefix_cached()``, if it has one (else 0)."""
    cdef Exchange e
    if type(x) is not Exchange:
        fn = getattr(x, "prefix_cached", None)
        return fn() if fn is not None else 0.0
    e = <Exchange>x
    return (<Router?>e.ingress.router).cached_room(e.pool, e.info)


set_waiter(Exchange, _x_waiting, _x_granted)
set_locality(_x_locality)
