"""Start a sim engine as a subprocess on 127.0.0.1 for a test, and stop it for sure.

    with sim_engine("--max-num-seqs", "4", time_scale=20) as eng:
        status, body = eng.get("/v1/models")           # blocking; eng.url, eng.port
        eng.metric("vllm:num_requests_running")         # one value from /metrics
        r = await http_request(eng.port, "POST", "/v1/completions", {"prompt": "x"})  # async

    eng = start_sim_engine(model="m2")      # in a fixture: yield eng, then eng.stop()

The engine listens on a port it picks itself (``--port 0``) and prints it, so parallel
tests never race for a port; pass ``port=`` to force one. Startup waits until
``/health`` answers 200; a process that dies first raises with its stderr.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from velocity_fast.harness.ports import free_port  # below the ephemeral range
from velocity_fast.harness.sim import SimEngine, sim_command

REPO = Path(__file__).resolve().parents[2]

__all__ = [
    "SimEngine",
    "sim_engine",
    "start_sim_engine",
    "free_port",
    "sim_command",
    "open_request",
    "http_request",
    "sse_events",
    "OpenStream",
    "HTTPResponse",
]


def start_sim_engine(
    *flags: str,
    model: str = "sim-model",
    port: int = 0,
    time_scale: float | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> SimEngine:
    """Start a sim engine and return it once healthy; call ``.stop()`` when done
    (in a fixture: ``eng = start_sim_engine(...); yield eng; eng.stop()``)."""
    return SimEngine(*flags, model=model, port=port, time_scale=time_scale, env=env).start(timeout)


@contextmanager
def sim_engine(
    *flags: str,
    model: str = "sim-model",
    port: int = 0,
    time_scale: float | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> Iterator[SimEngine]:
    """A sim engine for the duration of a ``with`` block, stopped even on failure."""
    eng = SimEngine(*flags, model=model, port=port, time_scale=time_scale, env=env)
    eng.start(timeout)
    try:
        yield eng
    finally:
        eng.stop()


# -- a small asyncio HTTP/1.1 client for talking to the sim engine in async tests --------


class HTTPResponse:
    """Status, lower-case headers and body of one response."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


class OpenStream:
    """A request whose response is read as it arrives (SSE), on its own connection.

    ``events()`` yields each SSE event's text without the ``data: `` prefix (comments
    as they are); ``abort()`` drops the connection, as a client that goes away.
    """

    def __init__(self, reader, writer, status: int, headers: dict[str, str]) -> None:
        self._reader = reader
        self._writer = writer
        self.status = status
        self.headers = headers
        self._buf = b""
        self._eof = False

    async def _read_more(self) -> bool:
        r = self._reader
        if self._eof:
            return False
        if self.headers.get("transfer-encoding") == "chunked":
            line = await r.readline()
            if not line:
                self._eof = True
                return False
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await r.readline()
                self._eof = True
                return False
            data = await r.readexactly(size + 2)
            self._buf += data[:-2]
            return True
        data = await r.read(65536)
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def events(self):
        """Yield SSE events (``data:`` payloads, or comment lines) until the body ends."""
        while True:
            while b"\n\n" in self._buf:
                ev, self._buf = self._buf.split(b"\n\n", 1)
                text = ev.decode()
                yield text[6:] if text.startswith("data: ") else text
            if not await self._read_more():
                if self._buf.strip():
                    yield self._buf.decode()
                return

    async def body(self) -> bytes:
        """The rest of the body (Content-Length, chunked, or up to the close)."""
        if "content-length" in self.headers and not self._eof:
            self._eof = True
            n = int(self.headers["content-length"]) - len(self._buf)
            if n > 0:
                self._buf += await self._reader.readexactly(n)
        while await self._read_more():
            pass
        out, self._buf = self._buf, b""
        return out

    def abort(self) -> None:
        """Close the connection at once (the client goes away)."""
        self._writer.transport.abort()

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass


async def open_request(
    port: int,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> OpenStream:
    """Send one request on a new connection to 127.0.0.1:port and read the head."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        h = {"host": f"127.0.0.1:{port}", "content-type": "application/json"}
        h.update({k.lower(): v for k, v in (headers or {}).items()})
        h["content-length"] = str(len(body or b""))
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        writer.write(head.encode() + (body or b""))
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except BaseException:
        writer.transport.abort()
        raise
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, v = ln.split(":", 1)
            hdrs[k.strip().lower()] = v.strip()
    return OpenStream(reader, writer, status, hdrs)


async def sse_events(
    port: int, path: str, body: dict, headers: dict | None = None, timeout: float = 30.0
) -> list[tuple[str, dict]]:
    """POST a streamed request and read its whole answer as (event name, data) pairs: the
    Responses and Messages APIs name their events; chat's have no name ("")."""
    s = await open_request(port, "POST", path, body, headers, timeout=timeout)
    assert s.status == 200
    try:
        raw = (await s.body()).decode()
    finally:
        await s.close()
    out = []
    for block in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


async def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> HTTPResponse:
    """One whole request/response on a new connection."""
    s = await open_request(port, method, path, body, headers, timeout)
    try:
        data = await asyncio.wait_for(s.body(), timeout)
    finally:
        await s.close()
    return HTTPResponse(s.status, s.headers, data)
