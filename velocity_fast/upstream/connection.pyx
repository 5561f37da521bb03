"""One keep-alive HTTP/1.1 connection to an engine, compiled: the future path for
coroutines, the handler path for callbacks (connection.pyi describes both).

Typed like the server's connection (server/connection.pyx): its fields are C struct members, and
the steps of a whole answer (read, scan, head, done) are C calls.
"""

import asyncio

import httptools

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeLatin1
from libc.string cimport memcmp

from velocity_fast.http.http1 cimport Head, take_response

from velocity_fast.http.http1 import response_headers
from velocity_fast.io.outbox cimport OutboxOwner, outbox_for
from velocity_fast.lowlevel.clock cimport event_begin, event_end
from velocity_fast.upstream.errors import UpstreamError


# Where the chunk scanner is in a chunked body (see _scan_chunks).
cdef enum:
    C_SIZE = 0       # in the chunk-size line: hex digits
    C_EXT = 1        # in a chunk extension, up to CR
    C_SIZE_LF = 2    # after the size line's CR
    C_DATA = 3       # in the chunk's data: _cleft bytes to go
    C_DATA_CR = 4    # after the data: CR
    C_DATA_LF = 5    # LF
    C_TRAILER = 6    # at the start of a trailer line (after the last chunk)
    C_TRAILER_LINE = 7
    C_TRAILER_LF = 8
    C_END_LF = 9     # the empty line that ends the message: its LF


cdef inline int _hex(unsigned char c) noexcept nogil:
    if c'0' <= c <= c'9':
        return c - c'0'
    if c'a' <= c <= c'f':
        return c - c'a' + 10
    if c'A' <= c <= c'F':
        return c - c'A' + 10
    return -1


cdef str _JSON = intern("application/json")  # the object http/heads.pyx knows at once


cdef class ResponseHandler:
    """What a callback-driven request is told (``UpstreamPool.request``): every such
    request's handler is one of these, its subclass overriding the methods. Each runs once
    at most, in this order: sent (the request went out on ``conn``), head (status and
    headers known), then done (the whole body is in ``conn.chunks``) or error.
    ``abandoned`` True: the handler no longer wants an answer. A handler that sets
    ``relaying`` (at the head) gets the body piece by piece, as it arrives, and done or
    error at its end. One that also sets ``raw_chunks`` gets a chunked body's whole chunks
    as they came, framing and all (to pass on to a chunked response unchanged), and the
    data of a chunk split across reads as a body piece.

    The connection calls the methods as C (``cpdef``): the gateway's exchange overrides
    them in C; a Python subclass (a test's) overrides them as Python methods of the same
    names. The defaults do nothing."""

    cpdef on_sent(self, UpstreamConnection conn):
        """The request went out on ``conn`` (to abort it on a cancel)."""

    cpdef on_head(self, UpstreamConnection conn):
        """The response head arrived."""

    cpdef on_body(self, UpstreamConnection conn, bytes data):
        """A piece of the body (only while ``relaying``)."""

    cpdef on_raw(self, UpstreamConnection conn, bytes framed):
        """Whole chunks, framed (only while ``relaying`` and ``raw_chunks``)."""

    cpdef on_done(self, UpstreamConnection conn):
        """The whole response arrived."""

    cpdef on_error(self, UpstreamConnection conn, err):
        """The request failed (``err.received``: after the engine began answering;
        ``conn`` None: no connection was made)."""


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
        self.handler = None
        self._resend = None
        self._parsing = False  # llhttp is inside a response
        self._reset()

    cdef _reset(self):
        self.status = 0
        self._headers = None  # llhttp's callbacks fill it; the scanner's path leaves it to `headers`
        self._hdata = None
        self.content_type = None
        self.has_length = False
        self.te_chunked = False
        self._head = None
        self.chunks = None  # the body pieces kept, once there are any
        self.done = False
        self.error = None
        self._waiter = None
        self._received = False
        self.keep_alive = True
        self._paused = False
        self._chunked = False
        self._raw = False

    # -- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport):
        self.transport = self._transport = transport

    def data_received(self, bytes data):
        cdef double prev = event_begin()
        try:
            self.received(data)
        finally:
            event_end(prev)

    cdef received(self, bytes data):
        cdef Head head
        self._received = True
        if self._chunked:
            self._scan_chunks(data, 0)
            return
        if not self._parsing and self.handler is not None:
            # The usual whole answer in one read: one call (http/http1.pyx), not llhttp's
            # callbacks; a stream's head, then its chunks, read here too (_scan_chunks);
            # anything else is llhttp's.
            if take_response(data, 0, &head) >= 0:
                if head.content_length >= 0:
                    if head.end + head.content_length == PyBytes_GET_SIZE(data):
                        self._whole_response(data, &head)
                        return
                elif head.chunked:
                    self._chunked_head(data, &head)
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
        self._parser = None  # it holds bound methods of this protocol: no cycle left for the GC
        if not self.done:
            self._fail(UpstreamError("engine closed the connection" + (f": {exc}" if exc else ""),
                                     received=self._received))
        self.pool.forget(self)

    def pause_writing(self):
        pass  # a request is written whole; nothing to hold back

    def resume_writing(self):
        pass

    def eof_received(self):
        pass  # None: the transport closes, and connection_lost reports it

    cdef _scanned_head(self, bytes data, Head* head):
        """The head the scanner read: what llhttp's callbacks would have set, the headers
        dict only when asked for (``headers``)."""
        self.status = head.status
        self.keep_alive = head.keep_alive != 0
        self._headers = None
        self._hdata = data
        self._hlines = head.lines
        self._hend = head.end
        self.has_length = head.content_length >= 0
        self.te_chunked = head.chunked
        if head.ct_start < 0:
            self.content_type = None
        elif head.ct_len == 16 and memcmp(PyBytes_AS_STRING(data) + head.ct_start, b"application/json", 16) == 0:
            self.content_type = _JSON  # the usual value, not decoded each time
        else:
            self.content_type = PyUnicode_DecodeLatin1(PyBytes_AS_STRING(data) + head.ct_start, head.ct_len, NULL)
        self._resend = None  # the answer has begun: no retry from here on

    property headers:
        """The response's headers: lower-case names (the last of a repeated name wins)."""
        def __get__(self):
            if self._headers is None:
                self._headers = {} if self._hdata is None else response_headers(self._hdata, self._hlines,
                                                                                 self._hend)
                self._hdata = None
            return self._headers

        def __set__(self, dict value):
            self._headers = value
            self._hdata = None

    cdef _whole_response(self, bytes data, Head* head):
        """What the parser callbacks below would have done for a response read whole."""
        cdef ResponseHandler handler
        self._scanned_head(data, head)
        self.handler.on_head(self)
        body = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + head.end, head.content_length) \
            if head.content_length else b""
        if body:
            handler = self.handler
            if handler is not None and handler.relaying:
                handler.on_body(self, body)
            elif self.chunks is None:
                self.chunks = [body]
            else:
                self.chunks.append(body)
        self._complete()

    cdef _complete(self):
        """The whole response is in: the handler's on_done, or the waiting coroutine woken."""
        cdef ResponseHandler handler = self.handler
        self.done = True
        if handler is not None:
            self.handler = None
            handler.on_done(self)
        else:
            self._wake()

    # -- chunked bodies, read here -----------------------------------------------------
    # A stream arrives as chunks, most reads holding whole ones (an SSE event each). Those
    # go on as they came, framing and all, to a handler that relays them to an HTTP/1.1
    # client (``raw_chunks`` set at the head: on_raw): nothing is taken apart and
    # put together again. A chunk split across reads goes as its pieces of data
    # (on_body, which frames each anew), so what the client gets is always whole
    # chunks, even when the engine stops in the middle of one. The last chunk and any
    # trailers end the message and are not passed on (the Responder ends its own stream).
    cdef _chunked_head(self, bytes data, Head* head):
        cdef ResponseHandler handler
        self._scanned_head(data, head)
        self._chunked = True
        self._cstate = C_SIZE
        self._csize = 0
        self._cdigits = 0
        self._cleft = 0
        self.handler.on_head(self)
        handler = self.handler
        self._raw = handler is not None and handler.relaying and handler.raw_chunks
        if not self.closed:
            self._scan_chunks(data, head.end)

    cdef _deliver(self, bytes piece):
        """A piece of the body (llhttp's, or data of a chunk read here): to a relaying
        handler, else kept for on_done or the waiting coroutine."""
        cdef ResponseHandler handler = self.handler
        if handler is not None and handler.relaying:
            handler.on_body(self, piece)
            return
        if self.chunks is None:
            self.chunks = [piece]
        else:
            self.chunks.append(piece)
        if handler is None:
            self._wake()

    cdef _scan_chunks(self, bytes data, Py_ssize_t pos):
        cdef const char* s = PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
        cdef Py_ssize_t cs = -1      # where the current chunk's size line began in this read
        cdef Py_ssize_t ds = pos     # where its data (still to hand over) begins in this read
        cdef Py_ssize_t run_s = -1, run_e = -1  # whole chunks of this read, passed on as they are
        cdef Py_ssize_t take
        cdef int st = self._cstate, h
        cdef unsigned char c
        while pos < n:
            c = <unsigned char>s[pos]
            if st == C_SIZE:
                h = _hex(c)
                if h >= 0:
                    if self._cdigits == 0:
                        cs = pos
                    self._cdigits += 1
                    if self._cdigits > 15:
                        return self._bad_chunk()
                    self._csize = self._csize * 16 + h
                elif self._cdigits == 0:
                    return self._bad_chunk()
                elif c == c';' or c == c' ' or c == c'\t':
                    st = C_EXT  # an extension (or the spaces before one): skipped
                elif c == c'\r':
                    st = C_SIZE_LF
                else:
                    return self._bad_chunk()
                pos += 1
            elif st == C_EXT:
                if c == c'\r':
                    st = C_SIZE_LF
                elif c == c'\n':
                    return self._bad_chunk()
                pos += 1
            elif st == C_SIZE_LF:
                if c != c'\n':
                    return self._bad_chunk()
                pos += 1
                self._cdigits = 0
                if self._csize == 0:
                    st = C_TRAILER  # the last chunk: not passed on
                else:
                    self._cleft = self._csize
                    self._csize = 0
                    ds = pos
                    st = C_DATA
            elif st == C_DATA:
                take = min(self._cleft, n - pos)
                pos += take
                self._cleft -= take
                if self._cleft == 0:
                    st = C_DATA_CR
                    if not (self._raw and cs >= 0):
                        # Not whole in this read (or not relayed as it is): its data now.
                        self._flush_run(data, run_s, run_e)
                        run_s = -1
                        self._deliver(data[ds:pos])
                        if self.closed:
                            return
                        cs = -1
            elif st == C_DATA_CR:
                if c != c'\r':
                    return self._bad_chunk()
                pos += 1
                st = C_DATA_LF
            elif st == C_DATA_LF:
                if c != c'\n':
                    return self._bad_chunk()
                pos += 1
                st = C_SIZE
                if cs >= 0:  # a whole chunk: joins the run
                    if run_s < 0:
                        run_s = cs
                    run_e = pos
                    cs = -1
            elif st == C_TRAILER:
                if c == c'\r':
                    st = C_END_LF
                else:
                    st = C_TRAILER_LINE
                pos += 1
            elif st == C_TRAILER_LINE:
                if c == c'\r':
                    st = C_TRAILER_LF
                pos += 1
            elif st == C_TRAILER_LF:
                if c != c'\n':
                    return self._bad_chunk()
                st = C_TRAILER
                pos += 1
            else:  # C_END_LF
                if c != c'\n':
                    return self._bad_chunk()
                pos += 1
                self._cstate = st
                self._flush_run(data, run_s, run_e)
                if self.closed:
                    return
                if pos < n:
                    self.keep_alive = False  # bytes after the answer: the connection is not reused
                self._chunked = False
                self._complete()
                return
        self._cstate = st
        self._flush_run(data, run_s, run_e)
        if self.closed:
            return
        # The read ends inside a chunk: hand over the data it holds of it.
        if st == C_DATA and pos > ds:
            self._deliver(data[ds:pos])
        elif (st == C_DATA_CR or st == C_DATA_LF) and cs >= 0:
            self._deliver(data[ds:pos - (1 if st == C_DATA_LF else 0)])

    cdef _flush_run(self, bytes data, Py_ssize_t run_s, Py_ssize_t run_e):
        if run_s < 0 or self.closed:
            return
        cdef ResponseHandler handler = self.handler
        if handler is None:
            return
        if run_s != 0 or run_e != PyBytes_GET_SIZE(data):
            data = data[run_s:run_e]
        handler.on_raw(self, data)

    cdef _bad_chunk(self):
        self._chunked = False
        self._fail(UpstreamError("malformed response from engine: bad chunked framing", received=True))
        self._out = None
        if self.transport is not None:
            self.transport.close()

    # -- httptools callbacks --------------------------------------------------------
    def on_message_begin(self):
        self._parsing = True

    def on_header(self, bytes name, bytes value):
        if self._headers is None:
            self._headers = {}
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self):
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        h = self._headers
        if h is None:
            h = self._headers = {}
        self.content_type = h.get("content-type")
        self.has_length = "content-length" in h
        self.te_chunked = h.get("transfer-encoding", "").lower() == "chunked"
        if self.handler is not None:
            self._resend = None  # the answer has begun: no retry from here on
            self.handler.on_head(self)
            return
        h = self._head
        if h is not None and not h.done():
            h.set_result(None)

    def on_body(self, bytes body):
        self._deliver(body)

    def on_message_complete(self):
        self._parsing = False
        self._complete()

    # -- used by the relay ------------------------------------------------------------
    cpdef _fail(self, err):
        if self.error is None:
            self.error = err
        cdef ResponseHandler handler = self.handler
        if handler is not None:
            self.handler = None
            data, self._resend = self._resend, None
            if data is not None and not err.received and not handler.abandoned:
                # A reused connection the engine had closed while idle: send again on a fresh one.
                self.pool.connect_for(data, handler)
            else:
                handler.on_error(self, err)
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
        self.handler = None
        self._head = self._loop.create_future()
        self._outbox.write(self, data)  # leaves at the end of this loop pass (io/outbox.pyx)
        return self._head

    cpdef send_to(self, data, ResponseHandler handler, bint reused=False):
        """Send a whole request (bytes, or a (head, body) pair: one writev, no join)
        whose answer goes to ``handler``'s callbacks. On a ``reused`` connection a
        failure before any response byte sends it again on a fresh one (see
        UpstreamPool.request)."""
        self._reset()
        self.requests += 1
        self.handler = handler
        self._resend = data if reused else None
        if type(data) is tuple:
            self._outbox.write(self, <bytes>(<tuple>data)[0])
            self._outbox.write(self, <bytes>(<tuple>data)[1])
        else:
            self._outbox.write(self, <bytes?>data)

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
        self.chunks = None
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
        self.handler = None
        self._resend = None
        self._out = None  # a request not yet sent never leaves
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
