"""Prefill/decode disaggregation: one request through a prefill engine and a decode engine,
as vLLM's NixlConnector expects (docs/pd.md), compiled.

A pool whose endpoints have roles (``role: prefill | decode``) gets a ``PdPool``; the
front door then makes a ``PdExchange`` for its chat and completions requests, an
``Exchange`` whose dispatch runs the two legs under the one lease admission granted:

1. the decode engine is picked first (prefix and load, the lease's room), and claimed;
2. the decider: the prompt's part the decode engine does not hold (the router's prefix
   index) below ``pd.min_uncached_tokens``: the request runs there alone, as any other;
3. else the prefill engine is picked (prefix and load), and the prefill leg sent: the same
   route and request id, ``kv_transfer_params`` asking for a remote decode, one token,
   no stream. Its answer's ``kv_transfer_params`` go into the decode leg byte for byte,
   and the decode leg is the original request, relayed to the client as any answer is,
   its usage merged (the prompt and its cached tokens as the prefill engine saw them).

A prefill leg that fails or times out is retried once on another prefill engine, then
the client gets 503 and no decode leg is sent; the decode leg's own failures are the
Exchange's (a connect failure retried once elsewhere, the same params). A client that
leaves aborts whichever leg is in flight.
"""

import logging

import msgspec
import orjson

from velocity_fast.admission.bands cimport VF_BYTES_PER_TOKEN
from velocity_fast.admission.controller cimport Lease, Ticket
from velocity_fast.fleet.endpoint cimport Endpoint, Pool
from velocity_fast.gateway.exchange cimport Exchange, fill_exchange
from velocity_fast.gateway.ingress cimport Ingress, settle
from velocity_fast.gateway.usage cimport USAGE_EVENT_LEN, unframe, usage_event_at
from velocity_fast.http.heads cimport engine_request
from velocity_fast.http.message cimport Request
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.routing.router cimport Router
from velocity_fast.server.connection cimport Responder
from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection
from velocity_fast.upstream.pool cimport UpstreamPool

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

log = logging.getLogger("velocity.gateway")

# The prefill leg's ask, as vLLM's own proxy writes it: decode elsewhere, no remote yet.
_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}

# An exchange's legs.
cdef enum:
    _START = 0      # no decision yet
    _PREFILL = 1    # the prefill leg is in flight
    _DECODE = 2     # the decode leg (disaggregated) or the whole request (colocated)


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    prompt_tokens_details: dict | None = None


class _PrefillAnswer(msgspec.Struct):
    # Raw: passed to the decode leg byte for byte, whatever fields this vLLM adds.
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    usage: _Usage | None = None


_prefill_answer = msgspec.json.Decoder(_PrefillAnswer)


cdef class PdPool:
    """A pool's prefill/decode split (``Pool.pd``), rebuilt by ``configure_pools`` when its
    endpoints or the ``pd`` settings change; its counts outlive a rebuild."""

    def __init__(self, list not_decode, list not_prefill, long min_uncached, double prefill_timeout,
                 double max_in_flight=0.0):
        self.pending = {}
        self.not_decode = not_decode
        self.not_prefill = not_prefill
        self.min_uncached = min_uncached
        self.prefill_timeout = prefill_timeout
        self.max_in_flight = max_in_flight

    def snapshot(self):
        return {"min_uncached_tokens": self.min_uncached, "disaggregated": self.disaggregated,
                "colocated": self.colocated, "prefill_retries": self.prefill_retries,
                "prefill_failed": self.prefill_failed, "prefill_busy": self.prefill_busy,
                "max_prefill_tokens_in_flight": round(self.max_in_flight),
                "prefill_tokens_in_flight": {k: round(v) for k, v in self.pending.items()}}


def configure_pools(pools, settings):
    """Give each pool with roles its PdPool (``Pool.pd``), the others None: the front door's
    one check per request. Called when endpoints come or go and when settings change."""
    cdef Pool pool
    cdef Endpoint ep
    cdef PdPool old, pd
    for p in pools.values():
        pool = <Pool?>p
        roles = {(<Endpoint>e).role for e in pool.endpoints}
        if roles <= {"both"}:
            pool.pd = pool.decoders = None
            continue
        pool.decoders = [e for e in pool.endpoints if (<Endpoint>e).role != "prefill"]
        pd = PdPool([e for e in pool.endpoints if (<Endpoint>e).role == "prefill"],
                    [e for e in pool.endpoints if (<Endpoint>e).role == "decode"],
                    settings.pd.min_uncached_tokens, settings.pd.prefill_timeout_s,
                    settings.pd.max_prefill_tokens_in_flight)
        if pool.pd is not None:
            old = <PdPool>pool.pd
            pd.disaggregated, pd.colocated = old.disaggregated, old.colocated
            pd.prefill_retries, pd.prefill_failed = old.prefill_retries, old.prefill_failed
            pd.prefill_busy = old.prefill_busy
            pd.pending = old.pending  # the legs in flight settle into the new one
        pool.pd = pd


cdef Exchange new_pd_exchange(Ingress ingress, Request req, Responder resp, str route, Pool pool, Ticket ticket,
                              RouteInfo info, bytes body, str rid):
    """The front door's exchange for a pool with roles (as exchange.pyx's new_exchange)."""
    cdef PdExchange x = <PdExchange>fill_exchange(PdExchange.__new__(PdExchange), ingress, req, resp, route, pool,
                                                  ticket, info, body, rid)
    x.pd = <PdPool>pool.pd
    return x


cdef class PrefillLeg(ResponseHandler):
    """The prefill leg's answer, whole (vLLM's prefill answer is one small JSON), handed
    to its exchange once, with its timeout."""

    cpdef on_sent(self, UpstreamConnection conn):
        self.conn = conn

    cpdef on_done(self, UpstreamConnection conn):
        status = conn.status
        body = conn.take()
        (<UpstreamPool?>self.ep.upstream).release(conn)
        self.conn = None
        self._finish(status, body, None)

    cpdef on_error(self, UpstreamConnection conn, err):
        self.conn = None
        self._finish(0, None, err)

    def _timed_out(self):
        self.timer = None
        if self.over:
            return
        self._end_span(0, f"no answer within {self.x.pd.prefill_timeout:g} s")
        self.abort()
        self.over = False
        self._finish(0, None, f"no answer within {self.x.pd.prefill_timeout:g} s")

    cdef void _settle(self) except *:
        """Its tokens leave its engine's prefill load (once)."""
        cdef double left
        if self.pd is not None:
            left = <double>self.pd.pending.get(self.ep.name, 0.0) - self.tokens
            if left > 0.5:
                self.pd.pending[self.ep.name] = left
            else:
                self.pd.pending.pop(self.ep.name, None)
            self.pd = None

    cdef void _end_span(self, int status, err) except *:
        """Its span ends (once), with the engine's status or why there is none."""
        span, self.span = self.span, None
        if span is not None:
            try:
                self.trace.prefill_end(span, status, err)
            except Exception:  # a trace must never fail the request it describes
                pass

    cdef abort(self):
        """The leg ends unanswered: its engine connection closed (the engine aborts the
        request and frees its blocks)."""
        self._end_span(0, "abandoned: the client left")
        self._settle()
        self.over = True
        self.abandoned = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.conn is not None:
            self.conn.abort()
            self.conn = None

    cdef _finish(self, int status, body, err):
        cdef PdExchange x
        if self.over:
            return
        self.over = True
        self._settle()
        self._end_span(status, err)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        x = self.x
        self.x = None
        x._prefilled(self, status, body, err)


cdef class PdExchange(Exchange):
    """See the module doc."""

    cdef _dispatch(self):
        cdef Endpoint ep
        if self.phase == _START:
            return self._decide()
        ep = self._pick_claim()
        if ep is None:
            return self._none_left()
        if self.trace is not None:
            self.trace.route(ep, self.info)
        self._send(ep)

    cdef Endpoint _pick_claim(self):
        """The decode engine (prefill-only endpoints and those that failed left out), bound
        to the lease; None when none is left."""
        cdef Lease lease = self.lease
        cdef Router router = self.ingress.router
        cdef Endpoint ep, first
        excl = self.pd.not_decode + self.tried if self.tried else self.pd.not_decode
        if self.trace is not None:
            self.trace.routing(router, self.info)
        ep = self._pick(router, excl)
        if ep is None:
            return None
        if not lease.claim(ep):  # workers: as Exchange._dispatch
            first = ep
            full = list(excl)
            while ep is not None and not lease.claim(ep):
                full.append(ep)
                ep = router.pick(self.pool, self.info, self.ingress.admission.has_room, full)
            if ep is None:
                ep = first
                lease.force(ep)
        return ep

    cdef _none_left(self):
        self._account(0, 0, 0, True)
        self._fail_lease(None)
        if self.tried:
            return self._refuse(502, "upstream", "The engine failed before answering and no other engine "
                                                 "could take the request.")
        return self._refuse(503, "no-endpoint", f"No healthy decode engine for model `{self.pool.model}`.", 1.0)

    cdef _send(self, Endpoint ep):
        cdef UpstreamPool up = ep.upstream
        self.ep = ep
        key = ep.api_key
        auth = f"authorization: Bearer {key}\r\n".encode("latin-1") if key else b""
        if self.trace is not None:  # the engine's span becomes a child of this leg's
            auth += self.trace.client(ep, "colocated" if self.p_ep is None else "decode")
        (<Router>self.ingress.router).on_dispatch(ep, self.info)
        up.request(engine_request(up.json_post_head(self.up_path), self.rid, auth, self.body), self)

    cdef _decide(self):
        """Decode first, then whether the prompt's uncached part there pays for a prefill leg."""
        cdef Endpoint ep = self._pick_claim()
        cdef double share
        cdef long uncached
        cdef int started
        if ep is None:
            return self._none_left()
        self.ep = ep
        if self.trace is not None:
            self.trace.route(ep, self.info)
        share = (<Router>self.ingress.router).cached_on(self.pool, self.info, ep)
        uncached = <long>(self.ticket.prompt_bytes / VF_BYTES_PER_TOKEN * (1.0 - share))
        if uncached < self.pd.min_uncached:
            self.pd.colocated += 1
            self.phase = _DECODE
            return self._send(ep)
        self.phase = _PREFILL
        self.prefill_body = _prefill_body(self.body)
        started = self._start_prefill(True)
        if started == 1:
            self.pd.disaggregated += 1
            return
        # No prefill engine is healthy (0), or every one is at its bound (-1): the decode
        # engine computes the prompt itself.
        self.prefill_body = None
        if started < 0:
            self.pd.prefill_busy += 1
        else:
            self.pd.colocated += 1
        self.phase = _DECODE
        self._send(ep)

    cdef int _start_prefill(self, bint first) except -2:
        """The prefill leg to the best prefill engine not tried yet: 1 sent, 0 none left;
        -1 (``first``, the decision's own leg, not a retry) every prefill engine would pass
        ``pd.max_prefill_tokens_in_flight`` with it (one with no leg in flight takes it
        whatever its size)."""
        cdef Router router = self.ingress.router
        cdef Endpoint ep
        cdef UpstreamPool up
        cdef PrefillLeg leg
        cdef double least = 0.0
        # Not the decode engine itself (a role-both one): its prefill would be the same
        # work twice; none other left, it computes the prompt alone.
        excl = self.pd.not_prefill + [self.ep]
        if self.p_tried:
            excl += self.p_tried
        ep = self._pick_prefill(excl, &least)
        if ep is None:
            return 0
        if (first and self.pd.max_in_flight > 0.0 and least > self.pd.max_in_flight
                and least > self.p_tokens + 0.5):  # (a leg is in flight there already)
            return -1
        leg = PrefillLeg.__new__(PrefillLeg)
        leg.x = self
        leg.ep = ep
        leg.pd = self.pd
        leg.tokens = self.p_tokens
        self.pd.pending[ep.name] = self.pd.pending.get(ep.name, 0.0) + leg.tokens
        self.leg = leg
        leg.timer = self.loop.call_later(self.pd.prefill_timeout, leg._timed_out)
        up = ep.upstream
        key = ep.api_key
        auth = f"authorization: Bearer {key}\r\n".encode("latin-1") if key else b""
        if self.trace is not None:  # the prefill engine's span becomes a child of this leg's
            leg.trace = self.trace
            leg.span, line = self.trace.prefill(ep, leg.tokens)
            auth += line
        up.request(engine_request(up.json_post_head(self.up_path), self.rid, auth, self.prefill_body), leg)
        return 1

    cdef Endpoint _pick_prefill(self, list excl, double *least):
        """The prefill engine by prefix and token load: the least prefill work there with
        this prompt's added (its tokens not cached there, the router's prefix index, plus
        the uncached tokens of the prefill legs in flight there, set in ``least``); None
        when none is healthy. The engines' own gauges come a scrape late; a burst's legs
        must spread at once."""
        cdef Router router = self.ingress.router
        cdef Endpoint ep, best = None
        cdef double tokens = self.ticket.prompt_bytes / VF_BYTES_PER_TOKEN, score, best_score = 0.0
        cdef double own
        pending = self.pd.pending
        for x in self.pool.endpoints:
            ep = <Endpoint>x
            if not ep.healthy or ep in excl:
                continue
            own = tokens * (1.0 - router.cached_on(self.pool, self.info, ep))
            score = own + <double>pending.get(ep.name, 0.0)
            if best is None or score < best_score:
                best, best_score = ep, score
                self.p_tokens = own
        least[0] = best_score
        return best

    cdef _prefilled(self, PrefillLeg leg, int status, body, err):
        """The prefill leg's end: the decode leg with its params, a retry, or the 503."""
        try:  # a bug in it fails this request (500), not the connection it was called from
            self._after_prefill(leg, status, body, err)
        except Exception:
            self._crashed()

    cdef _after_prefill(self, PrefillLeg leg, int status, body, err):
        cdef Endpoint ep = leg.ep
        cdef Ingress ingress = self.ingress
        self.leg = None
        if self.abandoned:
            return
        if err is None and 200 <= status < 300:
            try:
                got = _prefill_answer.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                got = None
            params = bytes(got.kv_transfer_params) if got is not None else b"null"
            if params.startswith(b"{"):
                (<Router>ingress.router).on_dispatch(ep, self.info)  # it holds the prefix now
                self.p_ep = ep
                if got.usage is not None:
                    self.p_prompt = got.usage.prompt_tokens
                    d = got.usage.prompt_tokens_details
                    self.p_cached = int((d or {}).get("cached_tokens") or 0)
                self.body = _with_params(self.body, params)
                self.prefill_body = None
                self.phase = _DECODE
                # The decode engine's own time starts here: the prefill leg owns the
                # request's time to first token so far, not the decode engine's limit.
                self.lease.handed_over()
                return self._send(self.ep)
            err = "the prefill engine answered without kv_transfer_params (is its KV connector on?)"
        elif err is None and 400 <= status < 500:
            # The request itself is refused (vLLM's 400): that answer is the client's.
            return self._prefill_refused(ep, status, body)
        elif err is None:
            err = f"engine status {status}"
        ep.errors += 1
        if status >= 500 or getattr(err, "connect", False):
            ingress.monitor.passive_failure(ep, connect=getattr(err, "connect", False))
        if self.p_tried is None:
            self.p_tried = [ep]
        else:
            self.p_tried.append(ep)
        if len(self.p_tried) < 2:
            self.pd.prefill_retries += 1
            if self._start_prefill(False) == 1:
                return
        self.pd.prefill_failed += 1
        self._account(0, 0, 0, True)
        self._fail_lease(f"prefill failed: {err}")
        self._refuse(503, "prefill", f"The prefill engine failed: {err}", 1.0)

    cdef _prefill_refused(self, Endpoint ep, int status, body):
        self._end()
        self._account(0, 0, 0, True)
        settle(self.ingress, self.route, self.ticket.band, ep, self.lease, status, False, False,
               body[:2000].decode("utf-8", "replace"), 0)
        self.resp.send(status, body, content_type="application/json", headers=self.base_headers())

    # -- the decode leg's answer: usage as the prefill engine saw the prompt --------------
    cdef _answer(self, UpstreamConnection conn):
        if self.p_ep is not None and 200 <= conn.status < 300 and conn.chunks:
            conn.chunks = [_merge_usage(conn.take(), self.p_prompt, self.p_cached, False)]
        Exchange._answer(self, conn)

    cdef _relay(self, UpstreamConnection conn, bytes data, bint framed):
        if self.p_ep is not None and not self.merged and usage_event_at(
                PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), framed) >= 0:
            if framed:
                data = unframe(data)
                framed = False
            data = _merge_usage(data, self.p_prompt, self.p_cached, True)
            self.merged = True
        Exchange._relay(self, conn, data, framed)

    def on_disconnect(self):
        """The client left: the prefill leg in flight is aborted too."""
        if self.leg is not None:
            self.leg.abort()
            self.leg = None
            self.abandoned = True
        Exchange.on_disconnect(self)


cdef bytes _prefill_body(bytes body):
    """The prefill leg's body: the client's, asking for a remote decode of one token, whole."""
    d = orjson.loads(body)
    d["kv_transfer_params"] = _PREFILL_PARAMS
    d["max_tokens"] = 1
    if "max_completion_tokens" in d:
        d["max_completion_tokens"] = 1
    d["stream"] = False
    d.pop("stream_options", None)
    return orjson.dumps(d)


cdef bytes _with_params(bytes body, bytes params):
    """``body`` with ``"kv_transfer_params": params`` as its last member, byte for byte
    otherwise: a member the client sent of that name comes before it, and the last wins."""
    cdef Py_ssize_t end = body.rfind(b"}"), i
    if end < 0:
        return body
    i = end - 1
    while i >= 0 and body[i] in b" \t\r\n":
        i -= 1
    sep = b"" if i >= 0 and body[i] == 0x7B else b","  # an empty object: no comma
    return body[:end] + sep + b'"kv_transfer_params":' + params + body[end:]


cdef bytes _merge_usage(bytes data, long long prompt, long long cached, bint stream):
    """The answer (or stream piece) with its last usage object's prompt and cached tokens
    those the prefill engine reported, every other byte as it came."""
    cdef Py_ssize_t at = len(data), start, i, depth = 0, end = -1, n = len(data)
    while True:  # the last "usage" key whose value is an object (JSON may space its ':')
        at = data.rfind(b'"usage"', 0, at)
        if at < 0:
            return data
        start = at + 7
        while start < n and data[start] in b" \t\r\n":
            start += 1
        if start < n and data[start] == 0x3A:  # ':'
            start += 1
            while start < n and data[start] in b" \t\r\n":
                start += 1
            if start < n and data[start] == 0x7B:
                break
    for i in range(start, len(data)):
        c = data[i]
        if c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                end = i + 1
                break
    if end < 0:
        return data
    try:
        u = orjson.loads(data[start:end])
        completion = int(u.get("completion_tokens") or 0)
        u["prompt_tokens"] = prompt
        u["total_tokens"] = prompt + completion
        if cached:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        elif "prompt_tokens_details" in u:
            # As a colocated engine: the details only when the prefix cache served any.
            if stream:
                del u["prompt_tokens_details"]
            else:
                u["prompt_tokens_details"] = None
    except (ValueError, TypeError, AttributeError):
        return data
    return data[:start] + orjson.dumps(u) + data[end:]
