"""Stubs for velocity_fast.upstream.connection (one engine connection and its response handler)."""

import asyncio
from typing import Any

from velocity_fast.io.outbox import OutboxOwner

class ResponseHandler:
    """What a callback-driven request is told (``UpstreamPool.request``): sent, head, then
    done or error. Every handler subclasses it and overrides the methods it needs."""

    relaying: bool
    raw_chunks: bool
    abandoned: bool
    def on_sent(self, conn: UpstreamConnection) -> None:
        """The request went out on ``conn`` (to abort it on a cancel)."""
    def on_head(self, conn: UpstreamConnection) -> None:
        """The response head arrived."""
    def on_body(self, conn: UpstreamConnection, data: bytes) -> None:
        """A piece of the body (only while ``relaying``)."""
    def on_raw(self, conn: UpstreamConnection, framed: bytes) -> None:
        """Whole chunks, framed (only while ``relaying`` and ``raw_chunks``)."""
    def on_done(self, conn: UpstreamConnection) -> None:
        """The whole response arrived."""
    def on_error(self, conn: UpstreamConnection | None, err: BaseException) -> None:
        """The request failed (``err.received``: after the engine began answering)."""

class UpstreamConnection(OutboxOwner):
    """An asyncio Protocol for uvloop: one engine connection of an UpstreamPool."""

    pool: Any
    transport: Any
    status: int
    headers: dict[str, str]
    content_type: str | None
    has_length: bool
    te_chunked: bool
    chunks: list[bytes]
    done: bool
    error: BaseException | None
    keep_alive: bool
    closed: bool
    requests: int
    handler: ResponseHandler | None
    @property
    def _paused(self) -> bool: ...
    @property
    def _chunked(self) -> bool: ...
    def __init__(self, pool: Any, loop: asyncio.AbstractEventLoop) -> None: ...
    def connection_made(self, transport: Any) -> None: ...
    def data_received(self, data: bytes) -> None: ...
    def connection_lost(self, exc: BaseException | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...
    def eof_received(self) -> bool | None: ...
    def on_message_begin(self) -> None: ...
    def on_header(self, name: bytes, value: bytes) -> None: ...
    def on_headers_complete(self) -> None: ...
    def on_body(self, body: bytes) -> None: ...
    def on_message_complete(self) -> None: ...
    def send(self, data: bytes) -> asyncio.Future[None]:
        """Send a whole request; returns the future of the response head."""
    def send_to(self, data: bytes | tuple[bytes, bytes], handler: ResponseHandler, reused: bool = False) -> None:
        """Send a whole request whose answer goes to ``handler``'s callbacks."""
    async def wait_body(self) -> None:
        """Wait until body pieces are available, the response is done, or it failed."""
    def take(self) -> bytes: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def abort(self) -> None:
        """Close at once: the engine sees the disconnect and aborts the request."""
