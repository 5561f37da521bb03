"""One proxied request driven by callbacks, without a task, compiled: the ``Exchange``.

Admission grants at once or later (the exchange is the queue's waiter), the request
goes out on a pooled engine connection, and the engine's answer is sent on from its
parser callbacks: a whole answer from the last one, a stream event by event as each
piece arrives (reading from the engine pauses while the client's buffer is full).

The front door (gateway/ingress.pyx) makes one for every proxied route: the OpenAI
routes as they are, /generate with its answer reshaped (``generate``). A connect
failure is retried once elsewhere. Every admitted request ends its lease exactly once, a
client that leaves included ("cancelled", engine connection aborted). The Ingress
supplies the shared parts: router, admission, monitor, metrics and reject.
"""

import logging

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memcmp

from velocity_fast.admission.bands cimport VF_BYTES_PER_TOKEN
from velocity_fast.admission.controller cimport Admission, Lease, Ticket
from velocity_fast.gateway.ingress cimport Ingress, count_reject, count_request, internal_error, settle
from velocity_fast.gateway.usage cimport USAGE_EVENT_LEN, answer_usage, read_usage, unframe, usage_event_at
from velocity_fast.routing.route cimport RouteInfo
from velocity_fast.routing.router cimport Router
from velocity_fast.server.connection cimport Responder
from velocity_fast.upstream.pool cimport UpstreamPool
from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection

from velocity_fast.lowlevel.clock cimport event_begin, event_end, event_now
from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.gateway.identity cimport Tenant, tenant_settle_tokens
from velocity_fast.http.heads cimport engine_request, relay_lines, rid_header
from velocity_fast.http.message cimport Request
from velocity_fast.lowlevel.fmt cimport memmem, starts, tenths

from velocity_fast.admission.errors import Rejected
from velocity_fast.http.errors import stream_error_event

import orjson

log = logging.getLogger("velocity.gateway")

cdef str _JSON = intern("application/json")  # one object with http/heads.pyx's: its head needs no look-up


# An exchange's stages.
cdef enum:
    _ADMITTING = 0
    _QUEUED = 1
    _ADMITTED = 2
    _DONE = 3


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


cdef Exchange new_exchange(Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket, RouteInfo info,
                           bytes body, str rid):
    """A new Exchange, made without an __init__ call. Fields not set here start as None,
    0 or False: no lease, endpoint, engine connection or drain task yet; a streamed
    answer's fields (relaying, ct, status, events, first, engine_failed, error_text) are
    set in on_head when it begins, and only read after."""
    return fill_exchange(Exchange.__new__(Exchange), ingress, req, resp, route, pool, ticket, info, body, rid)


cdef Exchange fill_exchange(Exchange x, Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket,
                           RouteInfo info, bytes body, str rid):
    x.ingress = ingress
    x.loop = ingress.loop
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


def _run_grants(Ingress ingress):
    """The exchanges granted a lease since the last run, in the order of their grants."""
    cdef Exchange x
    cdef double prev = event_begin()  # one clock read for the whole run
    grants, ingress.grants = ingress.grants, []
    try:
        for x in grants:
            try:
                x._granted()
            except Exception:  # one exchange's failure must not strand the others
                log.exception("granted exchange failed")
    finally:
        event_end(prev)


# No @cython.freelist: Cython keeps one only for a base class, and Exchange extends ResponseHandler
# (it ignored the decorator here, with a warning at every build).
cdef class Exchange(ResponseHandler):
    """See the module doc. The engine connection's response handler (called as C), and admission's
    waiter while queued (``drive_exchanges`` tells admission so: the dispatch cycle calls
    ``waiting`` and ``granted`` as C)."""

    cpdef start(self):
        self.resp.add_disconnect_callback(self)  # itself, callable: no bound method to make
        try:
            got = self.adm.admit_nowait(self.ticket, self)
        except Rejected as e:
            self._account(0, 0, 0, True)  # nothing served: the quota's draw comes back
            self._reject_counted(e.reason)
            self._end()
            if self.trace is not None:
                self._trace_end(e.status, e.reason, e.retry_after, None)
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
        if ingress.grants is None:
            ingress.grants = []
        ingress.grants.append(self)
        if len(ingress.grants) == 1:
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
        if self.trace is not None:
            self._trace_end(e.status, e.reason, e.retry_after, None)
        self.ingress.app.reject(self.resp, self.route, e.status, e.reason, e.message, self.ticket.band, self.base_headers(),
                        e.retry_after, from_admission=True)

    # -- the engine ----------------------------------------------------------------------
    cdef _admitted(self, Lease lease):
        self.state = _ADMITTED
        self.lease = lease
        self.queue_s = event_now() - self.req.received_at
        pr = self.info.precise
        if pr is not None and pr.chain is None and pr.wait(self._tokens_ready):
            return  # a prompt new to precise routing: its pick waits for its tokens (a ms or two)
        self._dispatch()

    def _tokens_ready(self):
        """The precise pick's tokens are ready (or its wait is over): the lease it holds
        goes to its engine, unless the client left meanwhile (on_disconnect released it)."""
        if self.abandoned or self.state != _ADMITTED or self.ep is not None:
            return
        try:
            self._dispatch()
        except Exception:
            self._crashed()

    cdef _dispatch(self):
        cdef UpstreamPool up
        cdef Lease lease = self.lease
        cdef Router router
        cdef Endpoint ep
        ingress, tried = self.ingress, self.tried
        router = ingress.router
        trace = self.trace
        if trace is not None:
            trace.routing(router, self.info)
        ep = self._pick(router, tried)
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
        if trace is not None:  # the engine's span becomes a child of this attempt's
            auth += trace.attempt(ep, self.info)
        # The prompt is on its way to ep: requests that share its prefix follow it from now,
        # not from its answer's head (a whole answer's comes after the last token).
        router.on_dispatch(ep, self.info)
        up.request(engine_request(up.json_post_head(self.up_path), self.rid, auth, self.body), self)

    cdef Endpoint _pick(self, Router router, exclude):
        """The engine for this request, ``exclude`` left out: the lease's own band first
        (its has_room, as C); batch work that found no engine whose turn had come then
        takes one early within its share (Lease.skip_turn); last, any endpoint with room
        (the pool had headroom). None: none has."""
        cdef Lease lease = self.lease
        cdef Endpoint ep = router.pick(self.pool, self.info, lease, exclude)
        if ep is None and lease.skip_turn():
            ep = router.pick(self.pool, self.info, lease, exclude)
        if ep is None:
            ep = router.pick(self.pool, self.info, self.ingress.admission.has_room, exclude)
        return ep

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
        if self.trace is not None:
            self.trace.piece(data, self.first)
        if self.first:
            self.first = False
            self.lease.first_byte()
        # (chunk framing is hex digits and CRLFs: it never holds an event's bytes)
        self.events += _events(data, &err_at, &self.done_sent)
        if err_at >= 0 and not self.engine_failed:  # the engine's own error event (e.g. out of memory)
            self.engine_failed = True
            self.error_text = data[err_at:err_at + 2000].decode("utf-8", "replace")
        if self.want_usage and not self.usage_seen and usage_event_at(PyBytes_AS_STRING(data),
                                                                 PyBytes_GET_SIZE(data), framed) >= 0:
            if framed and self.usage_strip:  # the piece is cut: its data goes on as one chunk
                data = unframe(data)
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
        at = usage_event_at(s, n, framed)
        if at < 0 or not read_usage(s + at + USAGE_EVENT_LEN - 1, s + n, u):
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
        # vLLM writes members after the usage (its "system_fingerprint") on the stream's
        # last chunk: cut with the usage, they go onto the chunk before, where vLLM puts
        # them for a client that asked for no usage.
        close = _object_end(s + at + USAGE_EVENT_LEN - 1, end)
        if close != NULL and close + 1 < end - 1 and i >= 3 and s[i - 3] == c'}' and s[i - 2] == c'\n':
            return (data[:i - 3] + data[close + 1 - s:end - 1 - s] + data[i - 3:i]
                    + data[end - s + 2:])
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
        elif ok:
            self._learn_open()
        if self.trace is not None:
            self._trace_end(status, None, None, None)
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
        if self.trace is not None:
            self._trace_end(self.status, "upstream", None, None)
        settle(self.ingress, self.route, self.ticket.band, self.ep, self.lease, self.status, True, False, str(e),
                        self.events)

    cdef _answer(self, UpstreamConnection conn):
        cdef Endpoint ep = self.ep
        cdef long long u[3]
        cdef long tokens = 0  # the completion's tokens once its usage is read (0: the lease's estimate stands)
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
        raw = body  # the engine's, for a trace (a /generate answer is reshaped below)
        if not ok and status >= 400:
            error_text = body[:2000].decode("utf-8", "replace") if body else f"engine status {status}"
        if not self.want_usage:
            pass
        elif not ok:
            self._account(0, 0, 0, True)  # an engine's error answer served no tokens
        elif answer_usage(body, u):
            self._account(u[0], u[1], u[2], True)
            if self.open_est is not None:
                # Only a request that named no max tokens is judged by what was served: it
                # was predicted from served lengths too. One that named them was predicted
                # from its max tokens, so the service estimate keeps learning per token asked
                # (an answer that stops early must not make the next long budget look slow).
                tokens = u[2]
                self.open_est.observe(tokens)
        else:
            self._account(0, 0, 0, False)  # no usage in the answer: the estimate stands
        if self.reshape is not None and ok and starts(ct, "application/json"):
            native = self.reshape(self, body)
            if native is None:
                settle(self.ingress, self.route, self.ticket.band, ep, self.lease, 502, True, False,
                       "engine answered with an unexpected body", 0)
                if self.trace is not None:
                    self._trace_end(502, "upstream", None, None)
                return resp.send_error(502, "The engine answered with an unexpected body.",
                                       headers=self.out_headers())
            body = native
        settle(self.ingress, self.route, self.ticket.band, ep, self.lease, status, False, ok, error_text, tokens)
        # out_headers() as lines, written whole (http/heads.pyx)
        lines = relay_lines(self.rid, self.ep.name, self.queue_s * 1000.0, self.ticket.band)
        if self.trace is not None:
            self._trace_end(status, None, None, raw)
            lines += (<object>self.trace).header_line
        resp.send(status, body, content_type=ct, headers=lines)

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
            if self.trace is not None:
                self._trace_end(499, "cancelled", None, None)
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
        if self.trace is not None:  # 499: the client closed the request (nginx's word)
            self._trace_end(499, "cancelled", None, None)

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
        elif ok:
            self._learn_open()
        if self.trace is not None:
            self._trace_end(status, None, None, None)
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
        if self.trace is not None:
            self._trace_end(status, "shutdown", None, None)
        count_request(self.ingress, self.route, status, self.ticket.band)

    cpdef list base_headers(self):
        """The headers of every answer to this request, an error's too (made when needed)."""
        if self.trace is not None:
            return [("x-request-id", self.rid), ("traceparent", self.trace.traceparent)]
        return rid_header(self.rid)

    cdef void _trace_end(self, int status, reason, retry_after, body) except *:
        """The trace's spans end with the request (tracing on, this request sampled)."""
        try:
            self.trace.end(self, status, reason, retry_after, body)
        except Exception:  # a trace must never fail the request it describes
            log.exception("tracing: the spans of request %s could not be ended", self.rid)

    def out_headers(self):
        return self.base_headers() + [("x-velocity-endpoint", self.ep.name),
                                    ("x-velocity-queue-ms", tenths(self.queue_s * 1000.0).decode("ascii")),
                                    ("x-velocity-band", self.ticket.band)]

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

    cdef void _learn_open(self) except *:
        """A whole stream with no max tokens named: its usage teaches the pool's estimate."""
        if self.open_est is not None and self.usage_seen:
            self.open_est.observe(self.u_completion)

    cdef _reject_counted(self, str reason):
        if self.tenant is not None:
            count_reject(self.tenant, reason)

    cdef _refuse(self, int status, str reason, str message, retry_after=None):
        self._end()
        if self.trace is not None:
            self._trace_end(status, reason, retry_after, None)
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
            if self.trace is not None:
                self._trace_end(500, "internal", None, None)
        finally:
            internal_error(self.ingress, self.req, self.resp, self.rid, self.route,
                           self.ticket.band if self.ticket is not None else "-", None)


cdef bint _x_waiting(object x) except -1:
    return (<Exchange>x).waiting()


cdef void _x_granted(object x, Lease lease) except *:
    (<Exchange>x).granted(lease)


cdef double _x_locality(object x) except? -1.0:
    """Admission's locality fairness: how much of a queued request's prompt an engine
    with room holds (the router's prefix index); a waiter of another kind (a future) is
    not known: 0."""
    cdef Exchange e
    if type(x) is not Exchange:
        return 0.0
    e = <Exchange>x
    return (<Router?>e.ingress.router).cached_room(e.pool, e.info)


def drive_exchanges(Admission adm not None):
    """Have ``adm``'s dispatch cycle drive the gateway's exchanges as C (a waiting check and
    a grant, no Python call), and its locality fairness ask the router where a queued
    exchange's prefix is cached; the gateway's assembler calls it on every Admission it
    builds."""
    adm.set_waiter(Exchange, _x_waiting, _x_granted)
    adm.set_locality(_x_locality)


cdef const char* _object_end(const char* p, const char* end) noexcept:
    """The ``}`` that closes the JSON object opening at ``p`` (a usage object: no strings
    hold braces in it), or NULL before ``end``."""
    cdef int depth = 0
    while p < end:
        if p[0] == c'{':
            depth += 1
        elif p[0] == c'}':
            depth -= 1
            if depth == 0:
                return p
        p += 1
    return NULL


cdef class GenExchange(Exchange):
    """An Exchange for the generation routes that are not OpenAI's chat shape: the
    Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages). Their
    whole answers' usage names input_tokens and output_tokens (usage.pyx's walk reads
    them); their streams carry it in their own events, read here: the Responses API's
    ``response.completed`` (response.usage), the Messages API's ``message_start``
    (the prompt) and ``message_delta`` (the output). Chat's exchange stays as it was."""

    cdef _relay(self, UpstreamConnection conn, bytes data, bint framed):
        if self.want_usage and not self.usage_seen:
            self._read_events(unframe(data) if framed else data)
        Exchange._relay(self, conn, data, framed)

    cdef _read_events(self, bytes data):
        cdef bytes buf = self.tail + data if self.tail else data
        lines = buf.split(b"\n")
        self.tail = lines.pop()  # an event line the next piece ends
        for line in lines:
            if not line.startswith(b"data: ") or b'"usage"' not in line:
                continue
            try:
                obj = orjson.loads(line[6:])
                kind = obj.get("type")
                if kind == "response.completed":
                    u = obj["response"]["usage"]
                    self.u_prompt = int(u["input_tokens"])
                    self.u_cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
                    self.u_completion = int(u["output_tokens"])
                    self.usage_seen = True
                elif kind == "message_start":
                    u = obj["message"]["usage"]
                    self.u_prompt = int(u["input_tokens"])
                    self.u_cached = int(u.get("cache_read_input_tokens") or 0)
                elif kind == "message_delta":
                    u = obj["usage"]
                    if u.get("input_tokens") is not None:
                        self.u_prompt = int(u["input_tokens"])
                    self.u_completion = int(u["output_tokens"])
                    self.usage_seen = True
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not the shape expected: the estimate stands


cpdef start_generation(Ingress ingress, Request req, Responder resp, str route, pool, Ticket ticket, RouteInfo info,
                       bytes body, str rid, tenant, double q_est, bint stream, asked=None):
    """/v1/responses and /v1/messages on the same path as chat (gateway/routes.py):
    admission, routing, the engine's answer relayed as it comes, usage read from their
    own shapes (GenExchange). ``tenant``: the configured tenant, ``q_est``: the tokens
    drawn from its quota (settled from the answer's usage); ``asked``: the max tokens the
    request named (None: none), for its trace."""
    cdef GenExchange x = <GenExchange>fill_exchange(GenExchange.__new__(GenExchange), ingress, req, resp, route, pool,
                                            ticket, info, body, rid)
    x.tenant = tenant
    x.q_est = q_est
    x.prompt_est = <long long>(ticket.prompt_bytes / VF_BYTES_PER_TOKEN)
    x.stream_req = stream
    x.want_usage = tenant is not None or x.adm.settle_usage
    x.tail = b""
    if ingress.tracing is not None:  # tracing on: this request's trace, if it is sampled
        x.trace = ingress.tracing.begin(x, True, asked)
    x.start()
