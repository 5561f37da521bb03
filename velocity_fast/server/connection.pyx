"""The HTTP/1.1 server's connection (``HttpProtocol``) and response (``Responder``) objects,
compiled: the attributes each object reads on every request are C struct fields, and
the steps a request takes between them (parse, queue, answer, write, finish) are C calls
instead of Python frames. docs/internals.md describes what they do. Their writes leave
through the loop's outbox (io/outbox.pyx).
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

import asyncio
import logging
import weakref

import httptools
import orjson

from velocity_fast.lowlevel.clock cimport event_begin, event_end, event_now
from velocity_fast.io.fdio cimport FdTransport
from velocity_fast.lowlevel.fmt cimport str_eq

from velocity_fast.http.heads cimport FRAME_CHUNKED_CLOSE, FRAME_CHUNKED_KEEP, FRAME_CLOSE, stream_head, whole_answer
from velocity_fast.http.http1 cimport take_request, take_request_at
from velocity_fast.http.message cimport Request, new_request

from velocity_fast.http.errors import error_body, stream_error_event
from velocity_fast.http.heads import CONTINUE
from velocity_fast.server.errors import ClientDisconnected

log = logging.getLogger("velocity.server")

cdef str _HEAD_METHOD = "HEAD"
cdef str _JSON = intern("application/json")  # one object with http/heads.pyx's: its head needs no look-up
cdef bytes _CONTINUE = CONTINUE

# How a started response frames what write() gets. _IDLE: not started or already
# finished, so a write is a bug that would corrupt the next response on the connection.
cdef enum:
    _IDLE = 0
    _CHUNKED = 1
    _RAW = 2
    _DISCARD = 3

# What the connection's one timer does when its deadline passes (see HttpProtocol._arm).
cdef enum:
    _T_NONE = 0
    _T_IDLE = 1
    _T_READ = 2
    _T_LINGER = 3


from velocity_fast.io.outbox cimport Outbox, OutboxOwner, flush_out, outbox_for, transport_buffered


# -- responses ----------------------------------------------------------------------------

@cython.freelist(256)  # one per request: reused, not allocated and freed each time
cdef class Responder:
    """Writes the response of one request; see docs/internals.md."""

    def __init__(self, HttpProtocol proto, Request request):
        self.proto = proto
        self._request = request
        self.started = False
        self.finished = False
        self.disconnected = False
        self._mode = _IDLE
        self._keep = False
        self._callbacks = None
        self._task = None
        self.status = 0
        self.cut_short = False
        self._sse = False

    # -- whole responses -------------------------------------------------
    cpdef send(self, int status, bytes body=b"", content_type="application/json", headers=()):
        """A whole response with Content-Length. ``headers``: (name, value) pairs, or
        header lines already encoded (``b"name: value\\r\\n"`` each)."""
        cdef HttpProtocol proto
        cdef Request req
        cdef bint keep
        cdef Py_ssize_t n
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.finished = True
        self.status = status
        if self.disconnected:
            return
        proto = self.proto
        req = self._request
        keep = req.keep_alive and not proto._closing
        n = PyBytes_GET_SIZE(body)
        if n == 0 and content_type == "application/json":
            content_type = None  # no body, no type
        if str_eq(req.method, _HEAD_METHOD):
            body = b""
        if n < 16384:  # one write, one copy
            proto._write(whole_answer(status, content_type, headers, n, keep, body))
        else:
            proto._write(whole_answer(status, content_type, headers, n, keep, b""))
            proto._write(body)
        proto._response_done(self, keep)

    def send_json(self, int status, obj, *, headers=()):
        """A whole response whose body is `obj` encoded by orjson."""
        self.send(status, orjson.dumps(obj), headers=headers)

    def send_error(self, int status, str message, *, type=None, param=None, headers=()):
        """The error shape (docs/design.md, "Arrival")."""
        self.send(status, error_body(status, message, type, param), headers=headers)

    # -- streamed responses ----------------------------------------------
    def start(self, int status=200, *, content_type="text/event-stream", headers=()):
        """Begin a streamed response: chunked on HTTP/1.1, close-delimited on HTTP/1.0."""
        cdef Request req
        cdef int framing
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self.disconnected:
            return
        self._sse = type(content_type) is str and content_type.startswith("text/event-stream")
        req = self._request
        if req.http_version == "1.0":
            self._mode = _RAW
            framing = FRAME_CLOSE
        else:
            self._mode = _CHUNKED
            self._keep = self.proto._keep_alive_after(req)
            framing = FRAME_CHUNKED_KEEP if self._keep else FRAME_CHUNKED_CLOSE
        if req.method == "HEAD":
            # The head says what a GET would get; the body is not sent.
            self._mode = _DISCARD
        self.proto._write(stream_head(status, content_type, headers, framing))

    cpdef bint write_nowait(self, bytes data) except -1:
        """Queue one chunk without waiting; False once the client is gone.

        For producers that serve many streams from one loop (they check
        `paused` themselves instead of awaiting each write): while paused,
        what they queue stays in this process's memory.
        """
        if self.disconnected:
            return False
        mode = self._mode
        if mode == _CHUNKED:
            if data:  # an empty chunk would end the stream
                self.proto._write(b"%x\r\n%s\r\n" % (len(data), data))
        elif mode == _RAW:
            self.proto._write(data)
        elif mode == _IDLE:
            raise RuntimeError("response finished" if self.finished else "response not started")
        return True

    cpdef bint write_chunks(self, bytes framed) except -1:
        """Queue bytes already framed as whole chunks (a chunked stream passed on as it
        came: see ``chunked``); False once the client is gone."""
        if self.disconnected:
            return False
        if self._mode != _CHUNKED:
            raise RuntimeError("the response is not chunked")
        self.proto._write(framed)
        return True

    @property
    def chunked(self):
        """True while the response is a started chunked stream (what write_chunks needs)."""
        return self._mode == _CHUNKED

    @property
    def paused(self):
        """True while the client's transport buffer is above its high-water mark."""
        return self.proto.write_paused

    async def write(self, bytes data):
        """Write one chunk; waits while the client reads slowly; raises ClientDisconnected."""
        if self.disconnected:
            raise ClientDisconnected()
        self.write_nowait(data)
        if self.proto.write_paused:
            await self.proto._drain()

    def end(self):
        """Finish a streamed response."""
        cdef HttpProtocol proto
        if self.finished:
            return
        if not self.started:
            raise RuntimeError("response not started")
        self.finished = True
        mode = self._mode
        self._mode = _IDLE
        if self.disconnected:
            return
        proto = self.proto
        if mode == _CHUNKED:
            proto._write(b"0\r\n\r\n")
            proto._response_done(self, self._keep and not proto._closing)
        elif mode == _DISCARD:
            proto._response_done(self, self._keep and not proto._closing)
        else:
            proto._response_done(self, False)

    def abort(self):
        """Give up a started response that cannot be finished: the connection closes, and
        the client sees the response cut short (as when a task handler fails mid-stream)."""
        if self.finished or self.disconnected:
            return
        self.finished = True
        self._mode = _IDLE
        self.proto._close()

    def cut(self, str message):
        """The server's shutdown grace ran out before this response finished.

        The handler is told first, through its disconnect callbacks (``cut_short`` is then
        True, so it can tell a shutdown from a client that left): it must stop producing.
        Then the client gets an ending it can read, as an engine that fails mid-stream is
        relayed: nothing sent yet, a 503 in the error shape; a server-sent event stream,
        vLLM's error event and ``data: [DONE]``, then the stream's proper end. From then
        on the response counts as gone (writes raise ClientDisconnected). Another started
        response cannot be ended cleanly: False, and the server closes its connection.
        Returns whether the client got such an ending."""
        if self.finished or self.disconnected:
            return False
        if self.started and not (self._sse and (self._mode == _CHUNKED or self._mode == _RAW)):
            return False
        self.cut_short = True
        first, self._watcher = self._watcher, None
        cbs, self._callbacks = self._callbacks, None
        for cb in ([first] if first is not None else []) + (cbs or []):
            try:
                cb()
            except Exception:  # a callback must not keep the client from its ending
                log.exception("disconnect callback failed")
        if self.finished or self.disconnected:  # the handler ended it itself meanwhile
            return not self.disconnected
        if not self.started:
            self.send(503, error_body(503, message), _JSON, ())
        else:
            self.write_nowait(stream_error_event(message, 503, "ServiceUnavailableError"))
            self.end()
        self.disconnected = True
        return True

    # -- disconnects -------------------------------------------------------
    cpdef add_disconnect_callback(self, cb):
        """cb() runs once if the client goes away before the response ends (at once if gone)."""
        if self.disconnected:
            self.proto._loop.call_soon(cb)
            return
        if self._watcher is None and self._callbacks is None:
            self._watcher = cb  # the usual one (the exchange's): no list
        elif self._callbacks is None:
            self._callbacks = [cb]
        else:
            self._callbacks.append(cb)

    cpdef remove_disconnect_callback(self, cb):
        """Forget a callback added by add_disconnect_callback (no error if unknown)."""
        if self._watcher is not None and (self._watcher is cb or self._watcher == cb):
            self._watcher = None  # (a bound method made anew equals the one added)
        elif self._callbacks and cb in self._callbacks:
            self._callbacks.remove(cb)

    cpdef _lost(self):
        if self.disconnected:
            return
        self.disconnected = True
        self._mode = _IDLE
        first, self._watcher = self._watcher, None
        cbs, self._callbacks = self._callbacks, None
        if not self.finished and (first is not None or cbs):
            for cb in ([first] if first is not None else []) + (cbs or []):
                try:
                    cb()
                except Exception:  # a callback must not break the others
                    log.exception("disconnect callback failed")


# -- connections --------------------------------------------------------------------------

# Between requests, a read takes at most this much (HttpProtocol.recv_target).
cdef Py_ssize_t HEAD_READ = 32768


cdef class HttpProtocol(OutboxOwner):
    """One client connection (an asyncio Protocol for uvloop)."""

    def __init__(self, server):
        self._server = server
        self._loop = server.loop
        limits = server.limits
        self._handler = server.handler
        self._outbox = outbox_for(self._loop)
        self._parser = httptools.HttpRequestParser(self)
        self._client = None
        self._max_header_bytes = limits.max_header_bytes
        self._max_body_bytes = limits.max_body_bytes
        self._header_timeout = limits.header_timeout
        self._body_timeout = limits.body_timeout
        self._keepalive_timeout = limits.keepalive_timeout
        self._first_byte_timeout = limits.first_byte_timeout
        self._on_error = server.on_error
        self._linger_timeout = limits.linger_timeout
        self._max_pipelined = limits.max_pipelined
        self._write_buffer_high = limits.write_buffer_high
        # the request being parsed
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._head_raw = 0
        self._in_head = False
        self._body = []
        self._body_len = 0
        self._req = None
        self._pend = None
        self._pend_have = 0
        self._in_message = False
        # requests waiting their turn, and the one being answered
        self._queue = []
        self._active = None
        self._fatal = None
        self._ignore_input = False  # set once the connection is on its way out
        self._continue_pending = False
        # flow control and lifecycle
        self.write_paused = False
        self._drain_waiter = None
        self._read_paused = False
        self._closing = False
        self._closed = False
        # One timer per connection serves every timeout; see _arm.
        self._timer = None
        self._timer_at = 0.0
        self._deadline = 0.0
        self._on_deadline = _T_NONE
        self._timer_step = min(self._header_timeout, self._body_timeout)

    # -- connection lifecycle ----------------------------------------------
    def connection_made(self, transport):
        self._transport = transport
        if not self._server.connection_opened(self):  # accepted just before the listener closed
            transport.close()
            return
        transport.set_write_buffer_limits(high=self._write_buffer_high)
        peer = transport.get_extra_info("peername")
        self._client = tuple(peer[:2]) if peer else None
        # A new connection waits for its first byte as long as a head may take (nginx's
        # client_header_timeout), not the keep-alive time: then it is closed without an answer.
        self._arm(self._first_byte_timeout, _T_IDLE)

    def connection_lost(self, exc):
        self._closed = True
        self._out = None
        # The parser holds bound methods of this protocol: dropped here, a closed connection
        # is freed at once, not left for the cyclic GC (thousands of them under churn).
        self._parser = None
        self._on_deadline = _T_NONE
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._active is not None:
            self._active._lost()
        del self._queue[:]
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ClientDisconnected())
            self._drain_waiter.exception()  # mark retrieved: nobody may be waiting any more
        self._server.connection_closed(self)

    # -- output: gathered per loop pass (see the outbox above) -----------------------
    cdef _write(self, bytes data):
        self._outbox.write(self, data)
        self._out_bytes += len(data)
        # What waits here and in the transport together stays under the high-water mark
        # once the transport pauses (until then under 1.5 times it, the transport's own
        # share being under the mark): past it the bytes go to the transport now, whose
        # flow control then pauses the producer (one that never yields would otherwise
        # fill memory). The transport is asked (a Python call) only when that can matter.
        if (self.write_paused or self._out_bytes > self._write_buffer_high // 2) and \
                self._out_bytes + transport_buffered(self._transport) > self._write_buffer_high:
            flush_out(self)

    cpdef _close(self):
        """Close after what waits has been written."""
        if self._out is not None:
            flush_out(self)
        self._transport.close()

    def eof_received(self):
        # A client that half-closes is taken as gone (returning None closes the
        # transport): that is how a disconnect shows while a handler awaits. What
        # was answered already leaves first.
        if self._out is not None:
            flush_out(self)

    def pause_writing(self):
        self.write_paused = True

    def resume_writing(self):
        self.write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _drain(self):
        if self._closed:
            raise ClientDisconnected()
        if self._drain_waiter is None or self._drain_waiter.done():
            self._drain_waiter = self._loop.create_future()
        await self._drain_waiter

    # -- timers -------------------------------------------------------------
    # Each request moves the deadline three times (head, body, idle); a new timer
    # for each costs about a microsecond, so the deadline is a number and one
    # timer checks it. That timer never lies further ahead than the shortest
    # read timeout, so a new deadline is never earlier than the pending timer
    # (the linger time may be shorter: then, rarely, the timer is replaced).
    cdef _arm(self, double delay, int what):
        self._on_deadline = what
        # The C clock: the loop's own (loop.time()) is a Python call, and runs behind it by
        # at most its cache of one pass; _on_timer checks the loop's before acting.
        deadline = event_now() + delay
        self._deadline = deadline
        if self._timer is None or self._timer_at > deadline:
            self._schedule(deadline)

    cdef _schedule(self, double deadline):
        if self._timer is not None:
            self._timer.cancel()
        at = min(deadline, self._loop.time() + self._timer_step)
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self):
        self._timer = None
        what = self._on_deadline
        if what == _T_NONE:
            return
        if self._loop.time() + 0.001 < self._deadline:  # the loop clock counts milliseconds
            self._schedule(self._deadline)
            return
        self._on_deadline = _T_NONE
        if what == _T_IDLE:
            if self._active is None and not self._queue and not self._in_message:
                self._close()
        elif what == _T_READ:
            self._on_read_timeout()
        else:  # _T_LINGER
            self._close()

    cdef _on_read_timeout(self):
        if not self._in_message or self._fatal is not None:
            return
        head_done = self._req is not None or self._pend is not None
        if self._read_paused:
            # We stopped reading (too many pipelined requests), not the client sending.
            self._arm(self._body_timeout if head_done else self._header_timeout, _T_READ)
            return
        what = "request body" if head_done else "request head"
        self._fail(408, f"The {what} was not received within the read timeout.")

    # -- parsing ------------------------------------------------------------
    def data_received(self, bytes data):
        cdef double prev = event_begin()
        try:
            self.received(data)
        finally:
            event_end(prev)

    cdef received(self, bytes data):
        cdef Py_ssize_t pos, n, have
        if self._ignore_input:
            return
        if self._pend is not None:
            pos = self._fill(data)
            if self._pend is not None or self._ignore_input or pos == len(data):
                return
            data = data[pos:]  # the requests after it
        if not self._in_message:
            # Between requests: a plain request with a whole head is read in one call
            # (http/http1.pyx), its body filled in by _fill when it spans reads; anything
            # else, from where that stopped, goes to llhttp.
            pos = 0
            n = len(data)
            while True:
                req = take_request(data, pos, self._max_header_bytes, self._max_body_bytes, self._client,
                                   event_now(), &pos, &have)
                if req is None:
                    break
                if self._wait_body(req, have):
                    return
                self._take(req)
                if self._ignore_input or pos == n:
                    return
            if pos:
                data = data[pos:]
        if self._in_head:
            # httptools gathers a header line before it calls on_header, so a line
            # that never ends is counted here: the head began in an earlier read
            # and has not ended, so all of this read belongs to it.
            self._head_raw += len(data)
        while True:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                # llhttp stops after a complete request that asks for an upgrade;
                # we answer it as plain HTTP/1.1 (RFC 9110 lets a server ignore
                # Upgrade) and parse what follows with a fresh parser.
                if self._fatal is not None:
                    return
                data = data[e.args[0]:]
                self._parser = httptools.HttpRequestParser(self)
                if data:
                    continue
            except httptools.HttpParserError as e:
                self._fail(400, f"Malformed HTTP request: {e}.")
                return
            break
        if self._in_head and self._head_raw > self._max_header_bytes:
            self._fail(431, "Request headers are too large.")

    cdef received_buf(self, const char* buf, Py_ssize_t n):
        """A read in the poller's buffer. Between requests a plain request is scanned
        there (http1.take_request_at): its body is copied out once, straight into the
        bytes the request keeps, with no bytes object of the whole read. What follows
        it, and anything else, goes to ``received`` as bytes, made before the request is
        answered (the answer may run the loop's next reads into that buffer)."""
        cdef Py_ssize_t pos = 0, have = 0
        cdef Request req
        if self._ignore_input:
            return
        if self._pend is None and not self._in_message:
            req = take_request_at(buf, n, self._max_header_bytes, self._max_body_bytes, self._client,
                                  event_now(), &pos, &have)
            if req is not None:
                if self._wait_body(req, have):
                    return
                if pos == n:
                    self._take(req)
                    return
                rest = PyBytes_FromStringAndSize(buf + pos, n - pos)
                self._take(req)
                self.received(rest)
                return
        self.received(PyBytes_FromStringAndSize(buf, n))

    cdef bint _wait_body(self, Request req, Py_ssize_t have) except -1:
        """True, the request kept to be filled in as its body comes, when only ``have``
        bytes of its body are here."""
        if have >= PyBytes_GET_SIZE(req.body):
            return False
        self._pend = req
        self._pend_have = have
        self._in_message = True
        self._arm(self._body_timeout, _T_READ)
        return True

    cdef Py_ssize_t _fill(self, bytes data) except -1:
        """The next bytes of the pending request's body, copied into it; once it is
        whole the request is taken. Returns how many bytes of ``data`` it used."""
        cdef Request req = self._pend
        cdef Py_ssize_t size = PyBytes_GET_SIZE(req.body)
        cdef Py_ssize_t k = PyBytes_GET_SIZE(data)
        if k > size - self._pend_have:
            k = size - self._pend_have
        # The body is a bytes object only this request holds, not yet seen by anyone.
        memcpy(PyBytes_AS_STRING(req.body) + self._pend_have, PyBytes_AS_STRING(data), k)
        self.received_into(k)
        return k

    cdef char* recv_target(self, Py_ssize_t* room) noexcept:
        """The rest of a pending body, to be read straight into it (io/fdio.pyx). Between
        requests a read takes at most HEAD_READ bytes: a head and a body of up to about
        32 KiB come in one read, and the rest of a longer body lands in it directly
        rather than in the read buffer, then a bytes object, then the body."""
        cdef Request req = self._pend
        if req is None or self._ignore_input:
            if not self._in_message:
                room[0] = HEAD_READ
            return NULL
        room[0] = PyBytes_GET_SIZE(req.body) - self._pend_have
        return PyBytes_AS_STRING(req.body) + self._pend_have

    cdef int received_into(self, Py_ssize_t n) except -1:
        """n more bytes of the pending body were read into it: once it is whole the
        request is taken, as _fill does."""
        cdef Request req = self._pend
        self._pend_have += n
        if self._pend_have == PyBytes_GET_SIZE(req.body):
            self._pend = None
            self._in_message = False
            self._take(req)
        return 0

    cdef _take(self, Request req):
        """A whole request: answered now, or queued behind the ones before it."""
        if self._closing:
            req.keep_alive = False
        self._on_deadline = _T_NONE
        if self._active is None and not self._queue:
            self._answer(req)  # the usual case: nothing ahead of it
            return
        self._queue.append(req)
        if self._active is None:
            self._next()
        elif len(self._queue) >= self._max_pipelined and not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()

    def on_message_begin(self):
        self._in_message = True
        self._in_head = True
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._head_raw = 0
        self._body = []
        self._body_len = 0
        self._req = None
        self._arm(self._header_timeout, _T_READ)

    def on_url(self, bytes url):
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self._max_header_bytes:
            self._fail(431, "Request headers are too large.")

    def on_header(self, bytes name, bytes value):
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._max_header_bytes:
            self._fail(431, "Request headers are too large.")
            return
        self._headers.append((name, value))

    def on_headers_complete(self):
        cdef dict headers
        self._in_head = False
        if self._fatal is not None:
            return
        p = self._parser
        headers = {}
        for name, value in self._headers:
            k = name.decode("latin-1").lower()
            v = value.decode("latin-1")
            headers[k] = headers[k] + ", " + v if k in headers else v
        url = self._url
        q = url.find(b"?")
        if q >= 0:
            path, query = url[:q].decode("latin-1"), url[q + 1:].decode("latin-1")
        else:
            path, query = url.decode("latin-1"), ""
        method = p.get_method().decode()
        req = new_request(method, path, query, headers, p.get_http_version(),
                          p.should_keep_alive(), self._client, event_now(), b"")
        self._req = req
        cl = headers.get("content-length")
        if (method == "CONNECT" or "upgrade" in headers) and p.should_upgrade():
            # llhttp does not read the body of such a request; what follows the
            # head would be parsed as the next request, so refuse one with a body.
            if method == "CONNECT":
                self._fail(405, "CONNECT is not supported.")
                return
            if (cl is not None and cl != "0") or "transfer-encoding" in headers:
                self._fail(400, "An upgrade request with a body is not supported.")
                return
        if cl is not None and cl.isdigit() and int(cl) > self._max_body_bytes:
            self._fail(413, f"Request body of {cl} bytes is over the limit of "
                            f"{self._max_body_bytes} bytes.")
            return
        self._arm(self._body_timeout, _T_READ)
        expect = headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and req.http_version == "1.1":
            if self._active is None and not self._queue:
                self._write(_CONTINUE)
            else:
                # An interim response must not land inside the response before it.
                self._continue_pending = True

    def on_body(self, bytes body):
        if self._fatal is not None:
            return
        self._body_len += len(body)
        if self._body_len > self._max_body_bytes:
            self._fail(413, f"Request body is over the limit of {self._max_body_bytes} bytes.")
            return
        self._body.append(body)

    def on_message_complete(self):
        cdef Request req
        if self._fatal is not None or self._req is None:
            return
        req = self._req
        self._req = None
        self._in_message = False
        # The client sent its body without waiting: a late 100 would come after the answer.
        self._continue_pending = False
        req.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body = []
        self._take(req)

    # -- answering --------------------------------------------------------------
    cdef bint _keep_alive_after(self, Request req) except -1:
        # A pending connection error does not end the responses ahead of it: they
        # keep the connection open so the error can follow them in order.
        return req.keep_alive and not self._closing

    cdef _next(self):
        cdef Request req = self._queue.pop(0)
        if (self._read_paused and len(self._queue) <= self._max_pipelined // 2
                and self._fatal is None):
            self._read_paused = False
            self._transport.resume_reading()
        self._answer(req)

    cdef _answer(self, Request req):
        """The handler called for the request at the head of the line."""
        cdef Responder resp = Responder.__new__(Responder)  # __init__'s fields, without the call
        resp.proto = self
        resp._request = req
        self._active = resp
        try:
            coro = self._handler(req, resp)
        except Exception:
            self._handler_failed(req, resp)
            if self._active is resp:
                self._active = None
                if not self._closed:
                    self._close()
            return
        if coro is None:
            return  # answered already, or the handler answers from its own callbacks
        task = self._loop.create_task(self._run(coro, req, resp))
        resp._task = task
        self._server.task_started(task)

    cdef _handler_failed(self, Request req, Responder resp, str what=None):
        """The handler raised (called in the except clause) or, with ``what``, returned
        without answering: the server's on_error answers, else a bare 500."""
        if self._on_error is not None:
            try:
                self._on_error(req, resp, what)
                return
            except Exception:
                log.exception("the server's on_error failed for %s %s", req.method, req.path)
        else:
            log.error("handler failed for %s %s%s", req.method, req.path, f": {what}" if what else "",
                      exc_info=what is None)
        if not resp.started:
            resp.send_error(500, what or "Internal server error.")
        elif not resp.finished:
            self._close()

    async def _run(self, coro, req, Responder resp):
        try:
            await coro
        except ClientDisconnected:
            if not resp.finished and not resp.disconnected:
                self._close()
        except asyncio.CancelledError:
            if not resp.finished and not resp.disconnected:
                self._close()
            raise
        except Exception:
            self._handler_failed(req, resp)
        else:
            if not resp.started:
                if resp.disconnected:
                    # The client left first: nobody to answer, and nothing went wrong.
                    log.debug("client gone before %s %s was answered", req.method, req.path)
                else:
                    self._handler_failed(req, resp, "The handler returned no response.")
            elif not resp.finished:
                resp.end()
        finally:
            if self._active is resp:  # the response never completed: the connection is done
                self._active = None
                if not self._closed:
                    self._close()
            self._server.task_ended(resp._task)

    cdef _response_done(self, Responder resp, bint keep_alive):
        """Called when a response has been fully written."""
        if self._active is not resp:
            return
        self._active = None
        if not keep_alive:
            self._close_after_answer()
            return
        if self._queue:
            self._next()
        elif self._fatal is not None:
            self._send_fatal()
        else:
            if self._continue_pending:
                self._continue_pending = False
                self._write(_CONTINUE)
            if not self._in_message:
                self._arm(self._keepalive_timeout, _T_IDLE)

    cdef _fail(self, int status, str message):
        """A connection-level error: answer it after the requests ahead of it, then close."""
        if self._fatal is not None:
            return
        self._fatal = (status, message)
        self._ignore_input = True
        self._on_deadline = _T_NONE
        if not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()
        if self._active is None and not self._queue:
            self._send_fatal()

    cdef _send_fatal(self):
        status, message = self._fatal
        body = error_body(status, message)
        self._write(whole_answer(status, _JSON, None, len(body), False, body))
        self._server.errors += 1
        self._linger()

    cdef _close_after_answer(self):
        if self._queue or self._in_message or self._read_paused:
            del self._queue[:]  # the client asked to close: what it sent after that goes unanswered
            self._linger()
        else:
            self._close()

    cdef _linger(self):
        """Half-close, drop what the client still sends, close on its EOF or after the linger time.

        Closing a socket with unread input makes the kernel send a reset that
        can destroy the answer before the client reads it (a client still
        sending a body it was refused, or requests pipelined after a close).
        """
        self._ignore_input = True
        flush_out(self)
        t = self._transport
        t.write_eof()
        if self._read_paused:
            self._read_paused = False
            t.resume_reading()
        self._arm(self._linger_timeout, _T_LINGER)

    # -- the server's view: what it counts, and shutdown (server/http_server.py) ------------
    @property
    def unanswered(self):
        """Requests taken and not yet answered in full: the one being answered, and those
        pipelined behind it."""
        return (self._active is not None) + len(self._queue)

    def shutdown(self):
        """The server is shutting down: close now when idle, else after the answers in hand."""
        self._closing = True
        if self._active is None and not self._queue and not self._ignore_input:
            self._close()

    def cut(self, str message):
        """The shutdown grace ran out: the response in hand ends as Responder.cut ends it,
        and the task of its handler, if it has one, is cancelled (it has nothing left to
        do). Whether its client got such an ending."""
        cdef Responder resp = self._active
        if resp is None or not resp.cut(message):
            return False
        if resp._task is not None:
            resp._task.cancel()
        return True

    def abort(self):
        """Close at once, dropping what waits to be written. The response in hand is marked
        gone first: a handler that runs before connection_lost sees a disconnect, not a
        dead transport."""
        if self._active is not None:
            self._active._lost()
        self._out = None
        self._transport.abort()
