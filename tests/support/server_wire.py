"""Raw-bytes HTTP/1.1 client and an in-process server for the server tests.

The tests control every byte a client sends, so the client here is a thin layer over
asyncio streams that parses responses strictly (interim 1xx apart, chunked framing
kept, close-delimited bodies read to EOF) and never sends anything by itself.

    async with serving(handler, header_timeout=0.2) as srv:
        async with connect(srv) as c:
            c.send(b"GET / HTTP/1.1\\r\\nHost: t\\r\\n\\r\\n")
            r = await c.response()
"""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator

from velocity_fast.server.http_server import HTTPServer
from velocity_fast.server.limits import ServerLimits

# Every wait of a test is bounded: a server that never answers fails the test in
# seconds instead of hanging until the pytest timeout.
WAIT = 5.0


class Response:
    """One parsed response."""

    def __init__(
        self,
        status: int,
        reason: str,
        headers: dict[str, str],
        body: bytes,
        chunks: list[bytes] | None,
        interim: list[int],
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.chunks = chunks  # the chunk payloads of a chunked body, else None
        self.interim = interim  # statuses of 1xx responses that came before it

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.headers} {self.body[:200]!r}>"


class Conn:
    """A client connection to 127.0.0.1 that sends raw bytes and parses responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def request(
        self,
        method: str = "GET",
        path: str = "/",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        version: str = "1.1",
    ) -> Response:
        """Send one request (Content-Length when body is given) and read its response."""
        self.send(build(method, path, body, headers, version))
        return await self.response(method=method)

    async def head(self) -> tuple[int, dict[str, str]]:
        """Read one response head: (status, lower-case headers)."""
        raw = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT)
        lines = raw[:-4].decode("latin-1").split("\r\n")
        proto, status, *reason = lines[0].split(" ", 2)
        assert proto in ("HTTP/1.1", "HTTP/1.0"), lines[0]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status), headers

    async def response(self, method: str = "GET") -> Response:
        """Read one final response, collecting any interim 1xx responses before it."""
        interim: list[int] = []
        while True:
            status, headers = await self.head()
            if 100 <= status < 200:
                interim.append(status)
                continue
            break
        chunks = None
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = [c async for c in self.chunks()]
            body = b"".join(chunks)
        elif "content-length" in headers:
            body = await asyncio.wait_for(self.reader.readexactly(int(headers["content-length"])), WAIT)
        else:
            body = await asyncio.wait_for(self.reader.read(), WAIT)  # close-delimited
        return Response(status, "", headers, body, chunks, interim)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield the payloads of a chunked body up to its last chunk; fails on bad framing."""
        while True:
            size = await self.chunk()
            if size is None:
                return
            yield size

    async def chunk(self) -> bytes | None:
        """One chunk payload of a chunked body; None for the last (empty) chunk."""
        line = await asyncio.wait_for(self.reader.readuntil(b"\r\n"), WAIT)
        n = int(line[:-2].split(b";")[0], 16)
        if n == 0:
            trailer = await asyncio.wait_for(self.reader.readuntil(b"\r\n"), WAIT)
            assert trailer == b"\r\n", trailer
            return None
        data = await asyncio.wait_for(self.reader.readexactly(n + 2), WAIT)
        assert data[-2:] == b"\r\n", data[-10:]
        return data[:-2]

    async def closed(self, timeout: float = WAIT) -> bool:
        """True when the server closes the connection (EOF or reset) with nothing more to read."""
        try:
            rest = await asyncio.wait_for(self.reader.read(65536), timeout)
        except (ConnectionResetError, BrokenPipeError):
            return True
        except asyncio.TimeoutError:
            return False
        assert rest == b"", f"unexpected bytes before close: {rest[:200]!r}"
        return True

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass

    def abort(self) -> None:
        """Drop the connection at once (the client going away)."""
        self.writer.transport.abort()


def build(
    method: str = "GET",
    path: str = "/",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    version: str = "1.1",
) -> bytes:
    """The bytes of one request; Content-Length is added when a body is given."""
    lines = [f"{method} {path} HTTP/{version}", "Host: test"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k in (headers or {})):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chunked(*parts: bytes) -> bytes:
    """A chunked request body of these parts, with its last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


@asynccontextmanager
async def connect(srv: HTTPServer, *, rcvbuf: int | None = None) -> AsyncIterator[Conn]:
    """A client connection that is closed when the block ends, also on failure."""
    if rcvbuf is None:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", srv.port), WAIT)
    else:
        sock = socket.socket()
        # A small receive window so that a client that does not read backs up the server quickly.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", srv.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=32768)
    conn = Conn(reader, writer)
    try:
        yield conn
    finally:
        await conn.close()


@asynccontextmanager
async def serving(handler, *, grace: float = 1.0, sndbuf: int | None = None, **limits) -> AsyncIterator[HTTPServer]:
    """An HTTPServer on 127.0.0.1 (a free port) with these limits, shut down when the block ends.

    `sndbuf` fixes the kernel send buffer of every accepted socket (they inherit it
    from the listener), so that what a slow reader leaves in flight is small and known.
    """
    limits.setdefault("linger_timeout", 0.5)
    srv = HTTPServer(handler, limits=ServerLimits(**limits), name="test")
    if sndbuf is None:
        await srv.start("127.0.0.1", 0)
    else:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", 0))
        await srv.start(sock=sock)
    try:
        yield srv
    finally:
        await srv.shutdown(grace=grace)


async def echo(req, resp) -> None:
    """A handler that answers what it got, as JSON."""
    resp.send_json(
        200,
        {
            "method": req.method,
            "path": req.path,
            "query": req.query,
            "body": req.body.decode("latin-1"),
            "version": req.http_version,
            "keep_alive": req.keep_alive,
            "client": list(req.client or ()),
        },
    )


async def still_serving(srv: HTTPServer, *others: Conn) -> None:
    """The server answers a good request on a new connection and on each open one."""
    async with connect(srv) as c:
        r = await c.request("POST", "/after", b"fine")
        assert r.status == 200, r
    for other in others:
        r = await other.request("GET", "/other")
        assert r.status == 200, r


def assert_error_shape(r: Response, status: int) -> dict:
    """The response is `status` with the one JSON error shape; returns the error object."""
    assert r.status == status, r
    assert r.headers["content-type"] == "application/json", r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    return err
