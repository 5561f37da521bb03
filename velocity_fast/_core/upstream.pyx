"""One keep-alive HTTP/1.1 connection to an engine, compiled (velocity_fast/upstream/connection.py
describes it: the future path for coroutines, the listener path for callbacks).

Typed like the server's connection (server.pyx): its fields are C struct members, and
the steps of a whole answer (read, scan, head, done) are C calls.
"""

import asyncio

import httptools

from velocity_fast._core.http1 import scan_response
from velocity_fast._core.server cimport OutboxOwner, outbox_for
from velocity_fast.upstream.errors import UpstreamError


cdef class UpstreamConnection(OutboxOwner):
    """An asyncio Protocol for uvloop: one engine connection of an UpstreamPool."""

    def __init__(self, pool, loop):
        self.pool = pool
        self._loop = loop
        self.transport = None
        self._outbox = outbox_for(loop)  # the request waits in _out until the end of the loop pass
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.requests = 0
        self.listener = None
        self._resend = None
        self._parsing = False  # llhttp is inside a response
        self._reset()

    cdef _reset(self):
        self.status = 0
        self.headers = {}
        self._head = None
        self.chunks = []
        self.done = False
        self.error = None
        self._waiter = None
        self._received = False
        self.keep_alive = True
        self._paused = False

    # -- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport):
        self.transport = self._transport = transport

    def data_received(self, bytes data):
        self._received = True
        if not self._parsing and self.listener is not None:
            # The usual whole answer in one read: one call (_core/http1.pyx), not llhttp's
            # callbacks; anything else is llhttp's.
            r = scan_response(data, 0)
            if r is not None and (<tuple>r)[4] == len(data):
                self._whole_response(<tuple>r)
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed response from engine: {e}", received=True))
            self._out = None
            self.transport.close()

    def connection_lost(self, exc):
        self.closed = True
        self._out = None
        if not self.done:
            self._fail(UpstreamError("engine closed the connection" + (f": {exc}" if exc else ""),
                                     received=self._received))
        self.pool._forget(self)

    def pause_writing(self):
        pass  # a request is written whole; nothing to hold back

    def resume_writing(self):
        pass

    def eof_received(self):
        pass  # None: the transport closes, and connection_lost reports it

    cdef _whole_response(self, tuple r):
        """What the parser callbacks below would have done for a response read whole."""
        self.status = r[0]
        self.headers = r[1]
        self.keep_alive = r[2]
        self._resend = None  # the answer has begun: no retry from here on
        self.listener.upstream_head(self)
        body = r[3]
        if body:
            listener = self.listener
            if listener is not None and listener.relaying:
                listener.upstream_body(self, body)
            else:
                self.chunks.append(body)
        self.done = True
        listener = self.listener
        if listener is not None:
            self.listener = None
            listener.upstream_done(self)
        else:
            self._wake()

    # -- httptools callbacks --------------------------------------------------------
    def on_message_begin(self):
        self._parsing = True

    def on_header(self, bytes name, bytes value):
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self):
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        if self.listener is not None:
            self._resend = None  # the answer has begun: no retry from here on
            self.listener.upstream_head(self)
            return
        h = self._head
        if h is not None and not h.done():
            h.set_result(None)

    def on_body(self, bytes body):
        listener = self.listener
        if listener is not None and listener.relaying:
            listener.upstream_body(self, body)
            return
        self.chunks.append(body)
        if listener is None:
            self._wake()

    def on_message_complete(self):
        self._parsing = False
        self.done = True
        listener = self.listener
        if listener is not None:
            self.listener = None
            listener.upstream_done(self)
            return
        self._wake()

    # -- used by the relay ------------------------------------------------------------
    cpdef _fail(self, err):
        if self.error is None:
            self.error = err
        listener = self.listener
        if listener is not None:
            self.listener = None
            data, self._resend = self._resend, None
            if data is not None and not err.received and not listener.abandoned:
                # A reused connection the engine had closed while idle: send again on a fresh one.
                self.pool._connect_for(data, listener)
            else:
                listener.upstream_error(self, err)
            return
        h = self._head
        if h is not None and not h.done():
            h.set_exception(err)
            h.exception()  # the relay may have gone; do not report it as unretrieved
        self._wake()

    cdef _wake(self):
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def send(self, bytes data):
        """Send a whole request; returns the future of the response head."""
        self._reset()
        self.requests += 1
        self.listener = None
        self._head = self._loop.create_future()
        self._outbox.write(self, data)  # leaves at the end of this loop pass (server.pyx's outbox)
        return self._head

    cpdef send_to(self, bytes data, listener, bint reused=False):
        """Send a whole request whose answer goes to ``listener``'s callbacks. On a
        ``reused`` connection a failure before any response byte sends it again on a
        fresh one (see UpstreamPool.request)."""
        self._reset()
        self.requests += 1
        self.listener = listener
        self._resend = data if reused else None
        self._outbox.write(self, data)

    async def wait_body(self):
        """Wait until body pieces are available, the response is done, or it failed."""
        if self.chunks or self.done or self.error is not None:
            return
        self._waiter = self._loop.create_future()
        await self._waiter

    cpdef bytes take(self):
        c = self.chunks
        if not c:
            return b""
        self.chunks = []
        return c[0] if len(c) == 1 else b"".join(c)

    cpdef pause(self):
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    cpdef resume(self):
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    cpdef abort(self):
        """Close at once: the engine sees the disconnect and aborts the request."""
        self.listener = None
        self._resend = None
        self._out = None  # a request not yet sent never leaves
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
