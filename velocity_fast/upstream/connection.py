"""One keep-alive HTTP/1.1 connection to an engine, parsed with httptools.

The response is handed over as it arrives: the head through a future, body
pieces into a list that the relaying coroutine drains. Reading from the engine
pauses while the relay asks for it (the client reads slowly), so flow control
holds end to end.

A request sent with a listener (see UpstreamListener) is answered through plain
callbacks instead: no future, no task. A whole answer arrives at once in
``upstream_done``; a listener that sets ``relaying`` at the head gets a stream
piece by piece (``upstream_body``) and pauses reading itself (``pause``/``resume``).
A listener may also hand the connection back to the future path at the head by
clearing ``conn.listener``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httptools

from .._core.http1 import scan_response
from ..server.outbox import OutboxOwner, outbox_for

if TYPE_CHECKING:  # pragma: no cover
    from .pool import UpstreamPool

__all__ = ["UpstreamConnection", "UpstreamError", "UpstreamListener"]


class UpstreamError(ConnectionError):
    """The engine connection failed. `sent_nothing` says the engine cannot have started
    the request's response (safe to retry elsewhere); `connect` says we never connected."""

    def __init__(self, message: str, *, connect: bool = False, received: bool = False) -> None:
        super().__init__(message)
        self.connect = connect
        self.received = received


class UpstreamListener:
    """What a callback-driven request is told (UpstreamPool.request). Each runs once at most,
    in this order: head (status and headers known), then done (the whole body is in
    ``conn.chunks``) or error. ``abandoned`` True: the listener no longer wants an answer.
    A listener that sets ``relaying`` (in upstream_head) gets the body piece by piece in
    upstream_body instead, as it arrives, and done or error at its end."""

    abandoned = False
    relaying = False

    def upstream_sent(self, conn: "UpstreamConnection") -> None:
        """The request went out on ``conn`` (to abort it on a cancel)."""

    def upstream_head(self, conn: "UpstreamConnection") -> None:
        """The response head arrived."""

    def upstream_body(self, conn: "UpstreamConnection", data: bytes) -> None:
        """A piece of the body (only while ``relaying``)."""

    def upstream_done(self, conn: "UpstreamConnection") -> None:
        """The whole response arrived."""

    def upstream_error(self, conn: "UpstreamConnection | None", err: "UpstreamError") -> None:
        """The request failed (``err.received``: after the engine began answering)."""


class UpstreamConnection(OutboxOwner):
    """An asyncio Protocol for uvloop; its outbox fields (_out, _out_bytes, _transport) are
    OutboxOwner's."""

    __slots__ = ("pool", "transport", "_outbox", "_parser", "_loop", "status", "headers", "_head",
                 "chunks", "done", "error", "_waiter", "_received", "keep_alive", "closed",
                 "_paused", "requests", "listener", "_resend", "_parsing")

    def __init__(self, pool: "UpstreamPool", loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._outbox = outbox_for(loop)  # the request waits in _out until the end of the loop pass
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.requests = 0
        self.listener: UpstreamListener | None = None
        self._resend: bytes | None = None
        self._parsing = False  # llhttp is inside a response
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future | None = None
        self.chunks: list[bytes] = []
        self.done = False
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._received = False
        self.keep_alive = True
        self._paused = False

    # -- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._received = True
        if not self._parsing and self.listener is not None:
            # The usual whole answer in one read: one call (_core/http1.pyx), not llhttp's
            # callbacks; anything else is llhttp's.
            r = scan_response(data, 0)
            if r is not None and r[4] == len(data):
                return self._whole_response(r)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed response from engine: {e}", received=True))
            self._out = None
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._out = None
        if not self.done:
            self._fail(UpstreamError("engine closed the connection" + (f": {exc}" if exc else ""),
                                     received=self._received))
        self.pool._forget(self)

    def _whole_response(self, r: tuple) -> None:
        """What the parser callbacks below would have done for a response read whole."""
        self.status, self.headers, self.keep_alive = r[0], r[1], r[2]
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
    def on_message_begin(self) -> None:
        self._parsing = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        if self.listener is not None:
            self._resend = None  # the answer has begun: no retry from here on
            self.listener.upstream_head(self)
            return
        h = self._head
        if h is not None and not h.done():
            h.set_result(None)

    def on_body(self, body: bytes) -> None:
        listener = self.listener
        if listener is not None and listener.relaying:
            listener.upstream_body(self, body)
            return
        self.chunks.append(body)
        if listener is None:
            self._wake()

    def on_message_complete(self) -> None:
        self._parsing = False
        self.done = True
        listener = self.listener
        if listener is not None:
            self.listener = None
            listener.upstream_done(self)
            return
        self._wake()

    # -- used by the relay ------------------------------------------------------------
    def _fail(self, err: UpstreamError) -> None:
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

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def send(self, data: bytes) -> asyncio.Future:
        """Send a whole request; returns the future of the response head."""
        self._reset()
        self.requests += 1
        self.listener = None
        self._head = self._loop.create_future()
        self._outbox.write(self, data)  # leaves at the end of this loop pass (server/outbox.py)
        return self._head

    def send_to(self, data: bytes, listener: UpstreamListener, *, reused: bool = False) -> None:
        """Send a whole request whose answer goes to ``listener``'s callbacks. On a
        ``reused`` connection a failure before any response byte sends it again on a
        fresh one (see UpstreamPool.request)."""
        self._reset()
        self.requests += 1
        self.listener = listener
        self._resend = data if reused else None
        self._outbox.write(self, data)

    async def wait_body(self) -> None:
        """Wait until body pieces are available, the response is done, or it failed."""
        if self.chunks or self.done or self.error is not None:
            return
        self._waiter = self._loop.create_future()
        await self._waiter

    def take(self) -> bytes:
        c = self.chunks
        if not c:
            return b""
        self.chunks = []
        return c[0] if len(c) == 1 else b"".join(c)

    def pause(self) -> None:
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close at once: the engine sees the disconnect and aborts the request."""
        self.listener = None
        self._resend = None
        self._out = None  # a request not yet sent never leaves
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
