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

from .._core.http1 import scan_request

from .outbox import flush_out, outbox_for
from .messages import REASONS, ClientDisconnected, Request, ServerLimits, error_body

__all__ = ["HTTPServer", "HttpProtocol", "Responder", "Handler"]

log = logging.getLogger("velocity.server")

# A handler answers through the Responder. It returns a coroutine (run as a task, the
# usual case) or None: then it has answered already, or arranged to answer from
# callbacks of its own (no task per request; it must watch for disconnects itself).
Handler = Callable[[Request, "Responder"], "Awaitable[None] | None"]

_STATUS_LINES = {code: f"HTTP/1.1 {code} {reason}\r\n".encode() for code, reason in REASONS.items()}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CT = {"application/json": b"content-type: application/json\r\n",
       "text/event-stream": b"content-type: text/event-stream\r\ncache-control: no-cache\r\n",
       "text/plain; version=0.0.4; charset=utf-8": b"content-type: text/plain; version=0.0.4; charset=utf-8\r\n"}

# How a started response frames what write() gets. _IDLE: not started or already
# finished, so a write is a bug that would corrupt the next response on the connection.
_IDLE, _CHUNKED, _RAW, _DISCARD = 0, 1, 2, 3


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} Status\r\n".encode()
    return line


def _head(status: int, content_type: str | None, headers: Iterable[tuple[str, str]] | bytes, extra: bytes) -> bytes:
    line = _STATUS_LINES.get(status) or _status_line(status)
    ct = b""
    if content_type:
        ct = _CT.get(content_type) or f"content-type: {content_type}\r\n".encode("latin-1")
    if headers.__class__ is bytes:  # lines already encoded by the caller (the proxy's hot path)
        return b"".join((line, ct, headers, extra))
    parts = [line, ct]
    for name, value in headers:
        parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    parts.append(extra)
    return b"".join(parts)


class Responder:
    """Writes the response of one request; see docs/internals.md."""

    __slots__ = ("_proto", "_request", "started", "finished", "disconnected", "_mode", "_keep",
                 "_callbacks", "_task", "status")

    def __init__(self, proto: "HttpProtocol", request: Request) -> None:
        self._proto = proto
        self._request = request
        self.started = False
        self.finished = False
        self.disconnected = False
        self._mode = _IDLE
        self._keep = False
        self._callbacks: list[Callable[[], None]] | None = None
        self._task: asyncio.Task | None = None
        self.status = 0

    # -- whole responses -------------------------------------------------
    def send(self, status: int, body: bytes = b"", *, content_type: str | None = "application/json",
             headers: Iterable[tuple[str, str]] | bytes = ()) -> None:
        """A whole response with Content-Length. ``headers``: (name, value) pairs, or
        header lines already encoded (``b"name: value\\r\\n"`` each)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.finished = True
        self.status = status
        if self.disconnected:
            return
        proto = self._proto
        req = self._request
        keep = req.keep_alive and not proto._closing
        extra = b"content-length: %d\r\n%s\r\n" % (
            len(body), b"connection: keep-alive\r\n" if keep else b"connection: close\r\n")
        head = _head(status, content_type if body or content_type != "application/json" else None,
                     headers, extra)
        if req.method == "HEAD":
            body = b""
        if len(body) < 16384:
            proto._write(head + body)
        else:
            proto._write(head)
            proto._write(body)
        proto._response_done(self, keep)

    def send_json(self, status: int, obj, *, headers: Iterable[tuple[str, str]] = ()) -> None:
        """A whole response whose body is `obj` encoded by orjson."""
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
        req = self._request
        if req.http_version == "1.0":
            self._mode = _RAW
            extra = b"connection: close\r\n\r\n"
        else:
            self._mode = _CHUNKED
            self._keep = keep = self._proto._keep_alive_after(req)
            extra = b"transfer-encoding: chunked\r\n%s\r\n" % (
                b"connection: keep-alive\r\n" if keep else b"connection: close\r\n")
        if req.method == "HEAD":
            # The head says what a GET would get; the body is not sent.
            self._mode = _DISCARD
        self._proto._write(_head(status, content_type, headers, extra))

    def write_nowait(self, data: bytes) -> bool:
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
                self._proto._write(b"%x\r\n%s\r\n" % (len(data), data))
        elif mode == _RAW:
            self._proto._write(data)
        elif mode == _IDLE:
            raise RuntimeError("response finished" if self.finished else "response not started")
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
        if not self.started:
            raise RuntimeError("response not started")
        self.finished = True
        mode = self._mode
        self._mode = _IDLE
        if self.disconnected:
            return
        proto = self._proto
        if mode == _CHUNKED:
            proto._write(b"0\r\n\r\n")
            proto._response_done(self, self._keep and not proto._closing)
        elif mode == _DISCARD:
            proto._response_done(self, self._keep and not proto._closing)
        else:
            proto._response_done(self, False)

    def abort(self) -> None:
        """Give up a started response that cannot be finished: the connection closes, and
        the client sees the response cut short (as when a task handler fails mid-stream)."""
        if self.finished or self.disconnected:
            return
        self.finished = True
        self._mode = _IDLE
        self._proto._close()

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
        """Forget a callback added by add_disconnect_callback (no error if unknown)."""
        if self._callbacks and cb in self._callbacks:
            self._callbacks.remove(cb)

    def _lost(self) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        self._mode = _IDLE
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
        self._outbox = outbox_for(self._loop)
        self._out: list[bytes] | None = None  # bytes waiting for the end of the loop pass
        self._out_bytes = 0
        self._parser = httptools.HttpRequestParser(self)
        self._client = None
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_raw = 0
        self._in_head = False
        self._body: list[bytes] = []
        self._body_len = 0
        self._req: Request | None = None
        self._in_message = False
        # requests waiting their turn, and the one being answered
        self._queue: deque[Request] = deque()
        self._active: Responder | None = None
        self._fatal: tuple[int, str] | None = None
        self._ignore_input = False  # set once the connection is on its way out
        self._continue_pending = False
        # flow control and lifecycle
        self._write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self._read_paused = False
        self._closing = False
        self._closed = False
        # One timer per connection serves every timeout; see _arm.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadline = 0.0
        self._on_deadline: Callable[[], None] | None = None
        self._timer_step = min(self._limits.header_timeout, self._limits.body_timeout)

    # -- connection lifecycle ----------------------------------------------
    def connection_made(self, transport) -> None:
        self._transport = transport
        self._server._connections.add(self)
        if self._server._idle is not None:  # accepted just before the listener closed
            transport.close()
            return
        transport.set_write_buffer_limits(high=self._limits.write_buffer_high)
        peer = transport.get_extra_info("peername")
        self._client = tuple(peer[:2]) if peer else None
        self._arm(self._limits.keepalive_timeout, self._on_idle_timeout)

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._out = None
        self._server._connections.discard(self)
        self._on_deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._active is not None:
            self._active._lost()
        self._queue.clear()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ClientDisconnected())
            self._drain_waiter.exception()  # mark retrieved: nobody may be waiting any more
        self._server._maybe_idle()

    # -- output: gathered per loop pass (see outbox.py) ------------------------
    def _write(self, data: bytes) -> None:
        self._outbox.write(self, data)
        self._out_bytes += len(data)
        if self._out_bytes + self._transport.get_write_buffer_size() > self._limits.write_buffer_high:
            # What waits here and in the transport together stays under the high-water
            # mark: past it the bytes go to the transport now, whose flow control then
            # pauses the producer (one that never yields would otherwise fill memory).
            flush_out(self)

    def _flush_out(self) -> None:
        flush_out(self)

    def _close(self) -> None:
        """Close after what waits has been written."""
        if self._out is not None:
            flush_out(self)
        self._transport.close()

    def eof_received(self) -> None:
        # A client that half-closes is taken as gone (returning None closes the
        # transport): that is how a disconnect shows while a handler awaits. What
        # was answered already leaves first.
        if self._out is not None:
            flush_out(self)

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
    # Each request moves the deadline three times (head, body, idle); a new timer
    # for each costs about a microsecond, so the deadline is a number and one
    # timer checks it. That timer never lies further ahead than the shortest
    # read timeout, so a new deadline is never earlier than the pending timer
    # (the linger time may be shorter: then, rarely, the timer is replaced).
    def _arm(self, delay: float, cb: Callable[[], None]) -> None:
        self._on_deadline = cb
        deadline = self._loop.time() + delay
        self._deadline = deadline
        if self._timer is None or self._timer_at > deadline:
            self._schedule(deadline)

    def _disarm(self) -> None:
        self._on_deadline = None

    def _schedule(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        at = min(deadline, self._loop.time() + self._timer_step)
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        cb = self._on_deadline
        if cb is None:
            return
        if self._loop.time() + 0.001 < self._deadline:  # the loop clock counts milliseconds
            self._schedule(self._deadline)
            return
        self._on_deadline = None
        cb()

    def _on_idle_timeout(self) -> None:
        if self._active is None and not self._queue and not self._in_message:
            self._close()

    def _on_read_timeout(self) -> None:
        if not self._in_message or self._fatal is not None:
            return
        head_done = self._req is not None
        if self._read_paused:
            # We stopped reading (too many pipelined requests), not the client sending.
            self._arm(self._limits.body_timeout if head_done else self._limits.header_timeout,
                      self._on_read_timeout)
            return
        what = "request body" if head_done else "request head"
        self._fail(408, f"The {what} was not received within the read timeout.")

    def _on_linger_timeout(self) -> None:
        self._close()

    # -- parsing ------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._ignore_input:
            return
        if not self._in_message:
            # Between requests: a plain, whole request is read in one call (_core/http1.pyx);
            # anything else, from where that stopped, goes to llhttp.
            limits = self._limits
            pos, n = 0, len(data)
            while True:
                r = scan_request(data, pos, limits.max_header_bytes, limits.max_body_bytes)
                if r is None:
                    break
                pos = r[6]
                self._whole_request(r)
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
        if self._in_head and self._head_raw > self._limits.max_header_bytes:
            self._fail(431, "Request headers are too large.")

    def _whole_request(self, r: tuple) -> None:
        """A request scan_request read whole: what the parser callbacks would have done."""
        req = Request(r[0], r[1], r[2], r[3], "1.1", r[4], self._client, time.monotonic())
        req.body = r[5]
        self._take(req)

    def _take(self, req: Request) -> None:
        """A whole request: answered now, or queued behind the ones before it."""
        if self._closing:
            req.keep_alive = False
        self._disarm()
        self._queue.append(req)
        if self._active is None:
            self._next()
        elif len(self._queue) >= self._limits.max_pipelined and not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()

    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head = True
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._head_raw = 0
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
        self._in_head = False
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
        method = p.get_method().decode()
        req = Request(method, path, query, headers, p.get_http_version(),
                      p.should_keep_alive(), self._client, time.monotonic())
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
        if cl is not None and cl.isdigit() and int(cl) > self._limits.max_body_bytes:
            self._fail(413, f"Request body of {cl} bytes is over the limit of "
                            f"{self._limits.max_body_bytes} bytes.")
            return
        self._arm(self._limits.body_timeout, self._on_read_timeout)
        expect = headers.get("expect")
        if expect is not None and expect.lower() == "100-continue" and req.http_version == "1.1":
            if self._active is None and not self._queue:
                self._write(_CONTINUE)
            else:
                # An interim response must not land inside the response before it.
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
        # The client sent its body without waiting: a late 100 would come after the answer.
        self._continue_pending = False
        req.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body = []
        self._take(req)

    # -- answering --------------------------------------------------------------
    def _keep_alive_after(self, req: Request) -> bool:
        # A pending connection error does not end the responses ahead of it: they
        # keep the connection open so the error can follow them in order.
        return req.keep_alive and not self._closing

    def _next(self) -> None:
        req = self._queue.popleft()
        if (self._read_paused and len(self._queue) <= self._limits.max_pipelined // 2
                and self._fatal is None):
            self._read_paused = False
            self._transport.resume_reading()
        resp = Responder(self, req)
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
        self._server._tasks.add(task)

    def _handler_failed(self, req: Request, resp: Responder) -> None:
        log.exception("handler failed for %s %s", req.method, req.path)
        if not resp.started:
            resp.send_error(500, "Internal server error.")
        elif not resp.finished:
            self._close()

    async def _run(self, coro: Awaitable[None], req: Request, resp: Responder) -> None:
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
                resp.send_error(500, "The handler returned no response.")
            elif not resp.finished:
                resp.end()
        finally:
            self._server._tasks.discard(resp._task)
            if self._active is resp:  # the response never completed: the connection is done
                self._active = None
                if not self._closed:
                    self._close()
            self._server._maybe_idle()

    def _response_done(self, resp: Responder, keep_alive: bool) -> None:
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
                self._arm(self._limits.keepalive_timeout, self._on_idle_timeout)

    def _fail(self, status: int, message: str) -> None:
        """A connection-level error: answer it after the requests ahead of it, then close."""
        if self._fatal is not None:
            return
        self._fatal = (status, message)
        self._ignore_input = True
        self._disarm()
        if not self._read_paused:
            self._read_paused = True
            self._transport.pause_reading()
        if self._active is None and not self._queue:
            self._send_fatal()

    def _send_fatal(self) -> None:
        status, message = self._fatal  # type: ignore[misc]
        body = error_body(status, message)
        self._write(_status_line(status) + b"content-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        self._server.errors += 1
        self._linger()

    def _close_after_answer(self) -> None:
        if self._queue or self._in_message or self._read_paused:
            self._queue.clear()  # the client asked to close: what it sent after that goes unanswered
            self._linger()
        else:
            self._close()

    def _linger(self) -> None:
        """Half-close, drop what the client still sends, close on its EOF or after the linger time.

        Closing a socket with unread input makes the kernel send a reset that
        can destroy the answer before the client reads it (a client still
        sending a body it was refused, or requests pipelined after a close).
        """
        self._ignore_input = True
        self._flush_out()
        t = self._transport
        t.write_eof()
        if self._read_paused:
            self._read_paused = False
            t.resume_reading()
        self._arm(self._limits.linger_timeout, self._on_linger_timeout)

    # -- shutdown -----------------------------------------------------------
    def _shutdown(self) -> None:
        self._closing = True
        if self._active is None and not self._queue and not self._ignore_input:
            self._close()


class HTTPServer:
    """An HTTP/1.1 server for one handler; see docs/internals.md."""

    def __init__(self, handler: Handler, *, limits: ServerLimits | None = None, name: str = "http") -> None:
        self.handler = handler
        self.limits = limits or ServerLimits()
        self.name = name
        self.errors = 0
        self._connections: set[HttpProtocol] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._idle: asyncio.Future | None = None
        self._stopping: asyncio.Task | None = None
        self.port = 0
        self.host = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, sock=None, backlog: int = 2048,
                    reuse_port: bool = False) -> None:
        """Listen on host:port (port 0 picks a free one; see `port`) or on `sock`."""
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
        """Open client connections."""
        return len(self._connections)

    @property
    def in_flight(self) -> int:
        """Handlers running now."""
        return len(self._tasks)

    def _maybe_idle(self) -> None:
        if (self._idle is not None and not self._idle.done() and not self._connections
                and not self._tasks):
            self._idle.set_result(None)

    async def shutdown(self, grace: float = 10.0) -> None:
        """Stop accepting, let in-flight responses finish within `grace`, then close everything."""
        if self._server is None:
            return
        if self._stopping is None:
            self._stopping = self._loop.create_task(self._shutdown(grace))
        await asyncio.shield(self._stopping)

    async def _shutdown(self, grace: float) -> None:
        self._server.close()
        self._idle = self._loop.create_future()
        for proto in list(self._connections):
            proto._shutdown()
        self._maybe_idle()
        try:
            await asyncio.wait_for(asyncio.shield(self._idle), grace)
        except asyncio.TimeoutError:
            for proto in list(self._connections):
                # Mark the response gone first: a handler that runs before
                # connection_lost must see a disconnect, not a dead transport.
                if proto._active is not None:
                    proto._active._lost()
                proto._out = None  # aborted: what waits is dropped
                proto._transport.abort()
            await asyncio.sleep(0)  # connection_lost runs: handlers see the disconnect
            # A handler that still runs would outlive its server: cancel it.
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
        await self._server.wait_closed()
        self._server = None
