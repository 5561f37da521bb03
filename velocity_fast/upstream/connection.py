"""One keep-alive HTTP/1.1 connection to an engine, parsed with httptools.

The response is handed over as it arrives: the head through a future, body
pieces into a list that the relaying coroutine drains. Reading from the engine
pauses while the relay asks for it (the client reads slowly), so flow control
holds end to end.

A request sent with a listener (see UpstreamListener) is answered through plain
callbacks instead: no future, no task, which is what a whole (non-streamed)
answer needs. The listener may hand the connection back to the future path at
the head (a streamed answer) by clearing ``conn.listener``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httptools

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
    ``conn.chunks``) or error. ``abandoned`` True: the listener no longer wants an answer."""

    abandoned = False

    def upstream_sent(self, conn: "UpstreamConnection") -> None:
        """The request went out on ``conn`` (to abort it on a cancel)."""

    def upstream_head(self, conn: "UpstreamConnection") -> None:
        """The response head arrived."""

    def upstream_done(self, conn: "UpstreamConnection") -> None:
        """The whole response arrived."""

    def upstream_error(self, conn: "UpstreamConnection | None", err: "UpstreamError") -> None:
        """The request failed (``err.received``: after the engine began answering)."""


class UpstreamConnection(asyncio.Protocol):
    __slots__ = ("pool", "transport", "_parser", "_loop", "status", "headers", "_head",
                 "chunks", "done", "error", "_waiter", "_received", "keep_alive", "closed",
                 "_paused", "requests", "listener", "_resend")

    def __init__(self, pool: "UpstreamPool", loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.requests = 0
        self.listener: UpstreamListener | None = None
        self._resend: bytes | None = None
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
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed response from engine: {e}", received=True))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.done:
            self._fail(UpstreamError("engine closed the connection" + (f": {exc}" if exc else ""),
                                     received=self._received))
        self.pool._forget(self)

    # -- httptools callbacks --------------------------------------------------------
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
        self.chunks.append(body)
        if self.listener is None:
            self._wake()

    def on_message_complete(self) -> None:
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
        self.transport.write(data)
        return self._head

    def send_to(self, data: bytes, listener: UpstreamListener, *, reused: bool = False) -> None:
        """Send a whole request whose answer goes to ``listener``'s callbacks. On a
        ``reused`` connection a failure before any response byte sends it again on a
        fresh one (see UpstreamPool.request)."""
        self._reset()
        self.requests += 1
        self.listener = listener
        self._resend = data if reused else None
        self.transport.write(data)

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
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
