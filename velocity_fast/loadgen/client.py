"""An HTTP/1.1 client on uvloop + httptools: a keep-alive connection pool that sends
pre-rendered request bytes and times responses (SSE streams token by token).

The Protocol callbacks only parse and record; each exchange is awaited through one
future. The pool never holds more connections than requests in flight, and the
caller bounds those (``--concurrency``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import deque
from dataclasses import dataclass, field

import httptools
import orjson

from .sse import SSETokenTimer

_REASON = b"x-velocity-reject-reason"
_ENDPOINT = b"x-velocity-endpoint"
_CTYPE = b"content-type"
_RETRY_AFTER = b"retry-after"
_RETRY_AFTER_MS = b"retry-after-ms"

_frozen_depth = 0


@contextlib.contextmanager
def frozen_heap():
    """Leave the objects the process already holds out of garbage collection while a run
    times requests, and give them back after.

    The client runs in its caller's process: a test runner late in a long suite, a bench
    with its earlier phases' results. Every full collection walks that whole heap, and the
    request that is waiting on the event loop meanwhile pays for it: with six million
    objects held, one two-replica isolation run measured high p95 2.72x idle, and 1.11x
    with them frozen (1.08x with no such heap). A client's pause is not the server's
    latency."""
    global _frozen_depth
    if _frozen_depth == 0:
        gc.collect()
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


@dataclass(slots=True)
class Result:
    """What one request came to; times are ``time.perf_counter()`` values."""

    index: int
    sent: float = 0.0
    done: float = 0.0
    status: int = 0  # 0: no HTTP response (connect error, reset, timeout)
    reason: str = ""  # x-velocity-reject-reason, or the transport error
    endpoint: str = ""
    first_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""  # a transport error, an error event inside a 200 stream, or
    # the message of an error answer (its body's error.message)
    retry_after: float | None = None  # seconds: retry-after-ms when given, else Retry-After

    @property
    def ok(self) -> bool:
        """A 200 with a complete, error-free body."""
        return self.status == 200 and not self.error


class _Exchange:
    __slots__ = ("result", "sse", "body", "waiter", "got_bytes", "headers_done")

    def __init__(self, result: Result, waiter: asyncio.Future) -> None:
        self.result = result
        self.sse: SSETokenTimer | None = None
        self.body: list[bytes] = []
        self.waiter = waiter
        self.got_bytes = False
        self.headers_done = False


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ex: _Exchange | None = None
        self.closed = False
        self.keep_alive = True

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        ex, self.ex = self.ex, None
        if ex is not None and not ex.waiter.done():
            ex.waiter.set_exception(ConnectionResetError(str(exc) if exc else "connection closed"))

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None:
            # Bytes nobody asked for: the connection is out of step, drop it.
            self.transport.close()
            return
        ex.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.ex = None
            self.transport.close()
            if not ex.waiter.done():
                ex.waiter.set_exception(ConnectionError(f"bad response: {e}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == _REASON:
            self.ex.result.reason = value.decode("latin-1")
        elif n == _ENDPOINT:
            self.ex.result.endpoint = value.decode("latin-1")
        elif n == _CTYPE and value.startswith(b"text/event-stream"):
            self.ex.sse = SSETokenTimer()
        elif n == _RETRY_AFTER_MS:
            try:
                self.ex.result.retry_after = float(value) / 1000.0
            except ValueError:
                pass
        elif n == _RETRY_AFTER and self.ex.result.retry_after is None:
            try:
                self.ex.result.retry_after = float(value)
            except ValueError:
                pass

    def on_headers_complete(self) -> None:
        self.ex.result.status = self.parser.get_status_code()
        self.ex.headers_done = True

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        if ex.sse is not None:
            ex.sse.feed(body, time.perf_counter())
        else:
            ex.body.append(body)

    def on_message_complete(self) -> None:
        ex, self.ex = self.ex, None
        self.keep_alive = self.parser.should_keep_alive()
        if ex is not None and not ex.waiter.done():
            ex.waiter.set_result(None)


class Client:
    """Sends requests to one host:port over pooled keep-alive connections."""

    def __init__(self, host: str, port: int, *, timeout: float = 300.0) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self._idle: deque[_Conn] = deque()
        self._all: set[_Conn] = set()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        self._all.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        if conn.closed or not conn.keep_alive:
            self._drop(conn)
        else:
            self._idle.append(conn)

    def _drop(self, conn: _Conn) -> None:
        self._all.discard(conn)
        if conn.transport is not None and not conn.closed:
            conn.transport.close()

    async def send(self, index: int, wire: bytes) -> Result:
        """Send one pre-rendered request and wait for the whole response."""
        result = Result(index=index)
        result.sent = time.perf_counter()
        # A pooled connection may have been closed by the server while idle; such a
        # failure (no byte back) is retried once on a fresh connection.
        for attempt in (0, 1):
            reused = False
            conn = None
            ex = None
            try:
                while self._idle:
                    c = self._idle.popleft()
                    if not c.closed:
                        conn, reused = c, True
                        break
                    self._all.discard(c)
                if conn is None:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for can drop a cancel.
                    async with asyncio.timeout(self.timeout):
                        conn = await self._connect()
                ex = _Exchange(result, asyncio.get_running_loop().create_future())
                conn.ex = ex
                conn.transport.write(wire)
                async with asyncio.timeout(self.timeout):
                    await ex.waiter
            except (OSError, asyncio.TimeoutError) as e:
                if conn is not None:
                    conn.ex = None
                    self._drop(conn)
                if attempt == 0 and reused and (ex is None or not ex.got_bytes):
                    result.status, result.reason = 0, ""
                    continue
                result.done = time.perf_counter()
                result.status = 0
                result.error = result.reason = "timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__
                return result
            except BaseException:
                if conn is not None:
                    conn.ex = None
                    self._drop(conn)
                raise
            break
        result.done = time.perf_counter()
        self._release(conn)
        _finish(result, ex)
        return result

    def close(self) -> None:
        """Close every connection."""
        for conn in list(self._all):
            self._drop(conn)
        self._idle.clear()


def _finish(result: Result, ex: _Exchange) -> None:
    sse = ex.sse
    if sse is not None:
        result.first_token = sse.first_token_at
        result.gaps = sse.gaps
        result.output_tokens = sse.usage_tokens if sse.usage_tokens is not None else sse.tokens
        if sse.error:
            result.error = sse.error
        return
    if result.status != 200:
        if ex.body:
            result.error = error_message(b"".join(ex.body))
        return
    if not ex.body:
        return
    try:
        obj = orjson.loads(b"".join(ex.body))
    except orjson.JSONDecodeError:
        result.error = "malformed JSON body"
        return
    if isinstance(obj, dict):
        usage = obj.get("usage")
        if isinstance(usage, dict):
            result.output_tokens = int(usage.get("completion_tokens") or 0)
        elif isinstance(obj.get("tokens_generated"), int):
            result.output_tokens = obj["tokens_generated"]


def error_message(body: bytes) -> str:
    """What an error answer says: the error shape's ``error.message`` (OpenAI's, the
    gateway's and vLLM's), else the start of the body as text."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(obj.get("message"), str):
            return obj["message"]
    return body[:300].decode("utf-8", "replace").strip()
