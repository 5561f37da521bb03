# cython: annotation_typing=False
"""A keep-alive connection pool per engine endpoint (compiled: the request path sends through it)."""

from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection

import asyncio
from urllib.parse import urlsplit

from velocity_fast.io import fdio
from velocity_fast.upstream.errors import UpstreamError

__all__ = ["UpstreamPool", "request_head"]


def request_head(method: str, path: str, host: bytes, headers: list[tuple[str, str]], body_len: int) -> bytes:
    """The request line and headers for one request with a Content-Length body."""
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers])
    if body_len or method == "POST":
        return b"%s %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n" % (
            method.encode("latin-1"), path.encode("latin-1"), host, lines.encode("latin-1"), body_len)
    return b"%s %s HTTP/1.1\r\nhost: %s\r\n%s\r\n" % (
        method.encode("latin-1"), path.encode("latin-1"), host, lines.encode("latin-1"))


cdef class UpstreamPool:
    """Idle keep-alive connections to one engine, reused most-recent first. The request
    path (``request``, ``idle_connection``, ``release``, ``json_post_head``) is typed C;
    connecting and the whole small requests of health checks (``fetch``) are coroutines."""

    def __cinit__(self):
        self._idle = []
        self._n_idle = 0
        self._json_posts = {}
        self.max_idle = 256
        self.base_path = ""
        self.host_header = b""

    def __init__(self, url: str, *, max_idle: int = 256, connect_timeout: float = 3.0) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", ""):
            raise ValueError(f"only http:// engine URLs are supported, got {url!r}")
        self.url = url.rstrip("/")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.base_path = u.path.rstrip("/")
        self.host_header = (u.netloc or f"{self.host}:{self.port}").encode("latin-1")
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self._all: set[UpstreamConnection] = set()
        self._connecting: set[asyncio.Task] = set()
        self.connects = 0

    def adopt(self, conn: UpstreamConnection) -> None:
        """An open connection made elsewhere (a benchmark's, on a transport of its own)
        joins the pool as an idle one."""
        self._all.add(conn)
        self._keep_idle(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        """The connection closed: no longer the pool's."""
        cdef Py_ssize_t i
        self._all.discard(conn)
        for i in range(self._n_idle):
            if self._idle[i] is conn:
                del self._idle[i]
                self._n_idle -= 1
                return

    async def connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # lands as the connect completes, and a task told to stop then runs on.
            async with asyncio.timeout(self.connect_timeout):
                if fdio.enabled():  # the gateway's own socket I/O (io/fdio.pyx)
                    _, conn = await fdio.open_connection(loop, lambda: UpstreamConnection(self, loop),
                                                         self.host, self.port)
                else:
                    _, conn = await loop.create_connection(lambda: UpstreamConnection(self, loop),
                                                           self.host, self.port)
        except (OSError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {self.url}: {e or 'timeout'}", connect=True) from None
        self.connects += 1
        self._all.add(conn)
        return conn

    async def open_request(self, data: bytes) -> UpstreamConnection:
        """Send a request; returns the connection once the response head arrived.

        A reused connection that the engine had closed while idle fails without any
        response byte: the request is sent again on a fresh connection.
        """
        conn = self.idle_connection()
        if conn is not None:
            try:
                await conn.send(data)
                return conn
            except UpstreamError as e:
                conn.abort()
                if e.received:
                    raise
            except BaseException:
                # Cancelled while waiting for the head (a non-streamed answer sends it last):
                # close, so that the engine sees the disconnect and aborts the request.
                conn.abort()
                raise
        conn = await self.connect()
        try:
            await conn.send(data)
        except BaseException:
            conn.abort()
            raise
        return conn

    def connect_for(self, data, ResponseHandler handler not None) -> None:
        """Connect a fresh connection and send ``data`` there, its answer to ``handler``."""
        task = asyncio.get_running_loop().create_task(self._connect_and_send(data, handler))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect_and_send(self, data, ResponseHandler handler) -> None:
        try:
            conn = await self.connect()
        except UpstreamError as e:
            if not handler.abandoned:
                handler.on_error(None, e)
            return
        except BaseException:
            # The pool closed under the connect (or a bug): the handler must still hear
            # of it, or its request would wait for an answer that never comes.
            if not handler.abandoned:
                handler.on_error(None, UpstreamError(f"no connection to {self.url}", connect=True))
            raise
        if handler.abandoned:  # unused: kept for the next request, within the bound
            if self._n_idle < self.max_idle:
                self._keep_idle(conn)
            else:
                conn.abort()
            return
        handler.on_sent(conn)
        conn.send_to(data, handler)

    async def fetch(self, method: str, path: str, *, body: bytes = b"",
                    headers: list[tuple[str, str]] | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
        """A whole small request (health checks, scrapes, model lists): (status, body)."""
        data = request_head(method, self.base_path + path, self.host_header, headers or [], len(body)) + body

        async def go() -> tuple[int, bytes]:
            conn = await self.open_request(data)
            try:
                parts = []
                while True:
                    await conn.wait_body()
                    if conn.chunks:
                        parts.append(conn.take())
                    if conn.error is not None:
                        raise conn.error
                    if conn.done:
                        break
                return conn.status, b"".join(parts)
            except BaseException:
                conn.abort()
                raise
            finally:
                self.release(conn)

        async with asyncio.timeout(timeout):  # not wait_for: see connect()
            return await go()

    def stats(self) -> dict:
        """The pool's size: connections open (in use, idle, or made and not yet sent on),
        idle ones, connects in progress, connects made, and the most kept idle."""
        return {"open": len(self._all), "idle": self._n_idle, "connecting": len(self._connecting),
                "connects": self.connects, "max_idle": self.max_idle}

    def close(self) -> None:
        for task in list(self._connecting):
            task.cancel()
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        self._n_idle = 0
        self._all.clear()

    cpdef bytes json_post_head(self, str path):
        """The start of a JSON POST to ``path``, up to the per-request headers: what
        request_head("POST", ...) writes first, built once per path."""
        if path is self._last_path:  # one route, one pool: the usual case (paths are shared strs)
            return self._last_head
        head = self._json_posts.get(path)
        if head is not None:
            self._last_path, self._last_head = path, head
        else:
            head = self._json_posts[path] = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
                (self.base_path + path).encode("latin-1"), self.host_header)
        return head

    cpdef UpstreamConnection idle_connection(self):
        cdef UpstreamConnection conn
        while self._n_idle > 0:
            self._n_idle -= 1
            conn = <UpstreamConnection>self._idle[self._n_idle]
            self._idle[self._n_idle] = None
            if not conn.closed:
                return conn
        return None

    cdef void _keep_idle(self, UpstreamConnection conn):
        if self._n_idle < len(self._idle):
            self._idle[self._n_idle] = conn
        else:
            self._idle.append(conn)
        self._n_idle += 1

    cpdef release(self, UpstreamConnection conn):
        """Return a connection whose response completed; anything else is closed."""
        if conn.closed:
            return
        if conn.done and conn.keep_alive and conn.error is None and self._n_idle < self.max_idle:
            conn.resume()
            self._keep_idle(conn)
        else:
            conn.abort()

    cpdef request(self, data, ResponseHandler handler):
        """Send a request whose answer goes to ``handler`` (see connection.pyx's ResponseHandler): bytes,
        or a (head, body) pair that leaves in one writev without being joined.

        On an idle connection this is all callbacks. With none idle, or when the
        reused one turns out closed by the engine before any response byte, a
        task connects a fresh one (as open_request does) and sends there.
        """
        conn = self.idle_connection()
        if conn is None:
            self.connect_for(data, handler)
            return
        handler.on_sent(conn)
        conn.send_to(data, handler, True)
