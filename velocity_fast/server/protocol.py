"""HTTP/1.1 server on asyncio Protocols and httptools.

The Protocol callbacks only parse, update state and schedule work (uvicorn's
httptools_impl is the model). Requests on one connection are answered in order:
pipelined requests wait in a queue; reading pauses when it grows too long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable, Iterable

import httptools
import orjson

from .messages import REASONS, ClientDisconnected, Request, ServerLimits, error_body

__all__ = ["HTTPServer", "HttpProtocol", "Responder", "Handler"]

log = logging.getLogger("velocity.server")

Handler = Callable[[Request, "Responder"], Awaitable[None]]

_STATUS_LINES = {code: f"HTTP/1.1 {code} {reason}\r\n".encode() for code, reason in REASONS.items()}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CT = {"application/json": b"content-type: application/json\r\n",
       "text/event-stream": b"content-type: text/event-stream\r\ncache-control: no-cache\r\n",
       "text/plain; version=0.0.4; charset=utf-8": b"content-type: text/plain; version=0.0.4; charset=utf-8\r\n"}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} Status\r\n".encode()
    return line


def _head(status: int, content_type: str | None, headers: Iterable[tuple[str, str]], extra: bytes) -> bytes:
    parts = [_status_line(status)]
    if content_type:
        ct = _CT.get(content_type)
        parts.append(ct if ct is not None else f"content-type: {content_type}\r\n".encode("latin-1"))
    for name, value in headers:
        parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    parts.append(extra)
    return b"".join(parts)


class Responder:
    """Writes the response of one request; see docs/internals.md."""

    __slots__ = ("_proto", "_request", "started", "finished", "disconnected", "_chunked",
                 "_callbacks", "status")

    def __init__(self, proto: "HttpProtocol", request: Request) -> None:
        self._proto = proto
        self._request = request
        self.started = False
        self.finished = False
        self.disconnected = False
        self._chunked = False
        self._callbacks: list[Callable[[], None]] | None = None
        self.status = 0

    # -- whole responses -------------------------------------------------
    def send(self, status: int, body: bytes = b"", *, content_type: str | None = "application/json",
             headers: Iterable[tuple[str, str]] = ()) -> None:
        """A whole response with Content-Length."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.finished = True
        self.status = status
        if self.disconnected:
            return
        keep = self._proto._keep_alive_after(self._request)
        extra = b"content-length: %d\r\n%s\r\n" % (
            len(body), b"connection: keep-alive\r\n" if keep else b"connection: close\r\n")
        head = _head(status, content_type if body or content_type != "application/json" else None,
                     headers, extra)
        if self._request.method == "HEAD":
            body = b""
        self._proto._transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self._proto._transport.write(body)
        self._proto._response_done(self, keep)

    def send_json(self, status: int, obj, *, headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send(status, orjson.dumps(obj), headers=headers)

    def send_error(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                   headers: Iterable[tuple[str, str]] = ()) -> None:
        """The error shape of DESIGN section 3."""
        self.send(status, error_body(status, message, type, param), headers=headers)

    # -- streamed responses ----------------------------------------------
    def start(self, status: int = 200, *, content_type: str | None = "text/event-stream",
              headers: Iterable[tuple[str, str]] = ()) -> None:
        """Begin a streamed response: chunked on HTTP/1.1, close-delimited on HTTP/1.0."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self.disconnected:
            return
        if self._request.http_version == "1.0":
            self._request.keep_alive = False
            extra = b"connection: close\r\n\r\n"
        else:
            self._chunked = True
            keep = self._proto._keep_alive_after(self._request)
            extra = b"transfer-encoding: chunked\r\n%s\r\n" % (
                b"connection: keep-alive\r\n" if keep else b"connection: close\r\n")
        self._proto._transport.write(_head(status, content_type, headers, extra))

    def write_nowait(self, data: bytes) -> bool:
        """Queue one chunk without waiting; False once the client is gone.

        For producers that serve many streams from one loop (they check
        `paused` themselves instead of awaiting each write).
        """
        if self.disconnected:
            return False
        if not data:
            return True
        if self._chunked:
            self._proto._transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self._proto._transport.write(data)
        return True

    @property
    def paused(self) -> bool:
        """True while the client's transport buffer is above its high-water mark."""
        return self._proto._write_paused

    async def write(self, data: bytes) -> None:
        """Write one chunk; waits while the client reads slowly; raises ClientDisconnected."""
        if self.disconnected:
            raise ClientDisconnected()
        self.write_nowait(data)
        if self._proto._write_paused:
            await self._proto._drain()

    def end(self) -> None:
        """Finish a streamed response."""
        if self.finished:
            return
        self.finished = True
        if self.disconnected:
            return
        if self._chunked:
            self._proto._transport.write(b"0\r\n\r\n")
            self._proto._response_done(self, self._request.keep_alive and not self._proto._closing)
        else:
            self._proto._response_done(self, False)

    # -- disconnects -------------------------------------------------------
    def add_disconnect_callback(self, cb: Callable[[], None]) -> None:
        """cb() runs once if the client goes away before the response ends (at once if gone)."""
        if self.disconnected:
            self._proto._loop.call_soon(cb)
            return
        if self._callbacks is None:
            self._callbacks = [cb]
        else:
            self._callbacks.append(cb)

    def remove_disconnect_callback(self, cb: Callable[[], None]) -> None:
        if self._callbacks and cb in self._callbacks:
            self._callbacks.remove(cb)

    def _lost(self) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        cbs, self._callbacks = self._callbacks, None
        if cbs and not self.finished:
            for cb in cbs:
                try:
                    cb()
                except Exception:  # a callback must not break the others
                    log.exception("disconnect callback failed")


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: "HTTPServer") -> None:
        self._server = server
        self._loop = server._loop
        self._limits = server.limits
        self._handler = server.handler
        self._transport: asyncio.Transport = None  # type: ignore[assignment]
        self._parser = httptools.HttpRequestParser(self)
        self._client = None
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._req: Request | None = None
        self._in_message = False
        # requests waiting their turn, and the one being answered
        self._queue: deque[Request] = deque()
        self._active: Responder | None = None
        self._task: asyncio.Task | None = None
        self._fatal: tuple[int, str] | None = None
        self._continue_pending = False
        # flow control and lifecycle
        self._write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self._read_paused = False
        self._closing = False
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None

    # -- connection lifecycle ----------------------------------------------
    def connection_made(self, transport) -> None:
        self._transport = transport
        transport.set_write_buffer_limits(high=self._limits.write_buffer_high)
        peer = transport.get_extra_info("peername")
        self._client = tuple(peer[:2]) if peer else None
        self._server._connections.add(self)
        self._arm(self._limits.keepalive_timeout, self._on_idle_timeout)

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._server._connections.discard(self)
        self._disarm()
        if self._active is not None:
            self._active._lost()
        self._queue.clear()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ClientDisconnected())
            self._drain_waiter.exception()  # mark retrieved: nobody may be waiting any more
        self._server._maybe_idle()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _drain(self) -> None:
        if self._closed:
            raise ClientDisconnected()
        if self._drain_waiter is None or self._drain_waiter.done():
            self._drain_waiter = self._loop.create_future()
        await self._drain_waiter

    # -- timers -------------------------------------------------------------
    def _arm(self, delay: float, cb) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay, cb)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_idle_timeout(self) -> None:
        self._timer = None
        if self._active is None and not self._queue and not self._in_message:
            self._transport.close()

    def _on_read_timeout(self) -> None:
        self._timer = None
        if self._in_message:
            what = "request body" if self._req is not None else "request head"
            self._fail(408, f"The {what} was not received within the read timeout.")

    # -- parsing ------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._fatal is not None:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "Protocol upgrades are not supported.")
        except httptools.HttpParserError as e:
            if self._fatal is None:
                self._fail(400, f"Malformed HTTP request: {e}.")

    def on_message_begin(self) -> None:
        self._in_message = True
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_len = 0
        self._req = None
        self._arm(self._limits.header_timeout, self._on_read_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self._limits.max_header_bytes:
            self._fail(431, "Request headers are too large.")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._limits.max_header_bytes:
            self._fail(431, "Request headers are too large.")
            return
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._fatal is not None:
            return
        p = self._parser
        headers: dict[str, str] = {}
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
        req = Request(p.get_method().decode(), path, query, headers, p.get_http_version(),
                      p.should_keep_alive(), self._client, time.monotonic())
        self._req = req
        cl = headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self._limits.max_body_bytes:
            self._fail(413, f"Request body of {cl} bytes is over the limit of "
                            f"{self._limits.max_body_bytes} bytes.")
            return
        self._arm(self._limits.body_timeout, self._on_read_timeout)
        if headers.get("expect", "").lower() == "100-continue" and req.http_version == "1.1":
            if self._active is None and not self._queue:
                self._transport.write(_CONTINUE)
            else:
                self._continue_pending = True

    def on_body(self, body: bytes) -> None:
        if self._fatal is not None:
            return
        self._body_len += len(body)
        if self._body_len > self._limits.max_body_bytes:
            self._fail(413, f"Request body is over the limit of {self._limits.max_body_bytes} bytes.")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._fatal is not None or self._req is None:
            return
        req = self._req
        self._req = None
        self._in_message = False
        req.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body = []
        if self._closing:
            req.keep_alive = False
        self._disarm()
        self._queue.append(req)
        if self._active is None:
            self._next()
        elif len(self._queue) >= self._limits.max_pipelined and not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()

    # -- answering --------------------------------------------------------------
    def _keep_alive_after(self, req: Request) -> bool:
        return req.keep_alive and not self._closing and self._fatal is None

    def _next(self) -> None:
        req = self._queue.popleft()
        if self._read_paused and len(self._queue) < self._limits.max_pipelined // 2:
            self._read_paused = False
            self._transport.resume_reading()
        resp = Responder(self, req)
        self._active = resp
        self._server.in_flight += 1
        self._task = self._loop.create_task(self._run(req, resp))

    async def _run(self, req: Request, resp: Responder) -> None:
        try:
            await self._handler(req, resp)
        except (ClientDisconnected, asyncio.CancelledError):
            if not resp.finished and not resp.disconnected:
                self._transport.close()
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.path)
            if not resp.started:
                resp.send_error(500, "Internal server error.")
            elif not resp.finished:
                self._transport.close()
        else:
            if not resp.started:
                resp.send_error(500, "The handler returned no response.")
            elif not resp.finished:
                resp.end()
        finally:
            self._server.in_flight -= 1
            if self._active is resp:  # the response never completed: the connection is done
                self._active = None
                if not self._closed:
                    self._transport.close()
            self._server._maybe_idle()

    def _response_done(self, resp: Responder, keep_alive: bool) -> None:
        """Called when a response has been fully written."""
        if self._active is not resp:
            return
        self._active = None
        if not keep_alive:
            self._transport.close()
            return
        if self._queue:
            self._next()
        elif self._fatal is not None:
            self._send_fatal()
        else:
            if self._continue_pending:
                self._continue_pending = False
                self._transport.write(_CONTINUE)
            if not self._in_message:
                self._arm(self._limits.keepalive_timeout, self._on_idle_timeout)

    def _fail(self, status: int, message: str) -> None:
        """A connection-level error: answer it after the requests ahead of it, then close."""
        if self._fatal is not None:
            return
        self._fatal = (status, message)
        self._disarm()
        if not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()
        if self._active is None and not self._queue:
            self._send_fatal()

    def _send_fatal(self) -> None:
        status, message = self._fatal  # type: ignore[misc]
        body = error_body(status, message)
        self._transport.write(_status_line(status) + b"content-type: application/json\r\n"
                              b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        self._transport.close()
        self._server.errors += 1

    # -- shutdown -----------------------------------------------------------
    def _shutdown(self) -> None:
        self._closing = True
        if self._active is None and not self._queue:
            self._transport.close()


class HTTPServer:
    """An HTTP/1.1 server for one handler; see docs/internals.md."""

    def __init__(self, handler: Handler, *, limits: ServerLimits | None = None, name: str = "http") -> None:
        self.handler = handler
        self.limits = limits or ServerLimits()
        self.name = name
        self.in_flight = 0
        self.errors = 0
        self._connections: set[HttpProtocol] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._idle: asyncio.Future | None = None
        self.port = 0
        self.host = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock=None, backlog: int = 2048,
                    reuse_port: bool = False) -> None:
        self._loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await self._loop.create_server(lambda: HttpProtocol(self), sock=sock,
                                                          backlog=backlog)
        else:
            self._server = await self._loop.create_server(lambda: HttpProtocol(self), host, port,
                                                          backlog=backlog, reuse_port=reuse_port or None)
        addr = self._server.sockets[0].getsockname()
        self.host, self.port = addr[0], addr[1]

    @property
    def connections(self) -> int:
        return len(self._connections)

    def _maybe_idle(self) -> None:
        if self._idle is not None and not self._idle.done() and not self._connections:
            self._idle.set_result(None)

    async def shutdown(self, grace: float = 10.0) -> None:
        """Stop accepting, let in-flight responses finish within `grace`, then close everything."""
        if self._server is None:
            return
        self._server.close()
        self._idle = self._loop.create_future()
        for proto in list(self._connections):
            proto._shutdown()
        self._maybe_idle()
        try:
            await asyncio.wait_for(asyncio.shield(self._idle), grace)
        except asyncio.TimeoutError:
            for proto in list(self._connections):
                if proto._transport is not None:
                    proto._transport.abort()
            await asyncio.sleep(0)
        await self._server.wait_closed()
        self._server = None
