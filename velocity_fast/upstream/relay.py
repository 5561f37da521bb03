"""Relaying one engine response to the client as it arrives."""

from __future__ import annotations

import time
from typing import Callable, Iterable

import orjson

from .connection import UpstreamConnection
from .errors import UpstreamError
from .pool import UpstreamPool

__all__ = ["relay_response", "RelayOutcome", "stream_error_event"]

_DONE = b"data: [DONE]\n\n"
_DATA = b"data: "


def stream_error_event(message: str, status: int = 500, type: str = "InternalServerError") -> bytes:
    """How vLLM reports an error after streaming began: an error event, then [DONE]."""
    return b"data: " + orjson.dumps({"error": {"message": message, "type": type, "param": None,
                                               "code": status}}) + b"\n\n" + _DONE


class RelayOutcome:
    """What happened, for the lease and the metrics."""

    __slots__ = ("status", "ok", "error_text", "events", "body", "first_byte_at", "engine_failed")

    def __init__(self) -> None:
        self.status = 0
        self.ok = False
        self.error_text: str | None = None
        self.events = 0              # SSE data events relayed (about one per token)
        self.body = b""              # the whole body of a non-streamed response
        self.first_byte_at = 0.0
        self.engine_failed = False   # the engine broke the response (not the client)


async def relay_response(pool: UpstreamPool, conn: UpstreamConnection, resp, headers: Iterable[tuple[str, str]],
                         *, on_first_byte: Callable[[], None] | None = None,
                         send_body: bool = True) -> RelayOutcome:
    """Relay the response whose head `conn` has received. The connection goes back to the
    pool when the response completed, and is closed otherwise (cancellation included).

    With send_body False a non-streamed body is returned in the outcome instead of sent
    (the native /generate route reshapes it).
    """
    out = RelayOutcome()
    out.status = status = conn.status
    ct = conn.headers.get("content-type", "application/json")
    streamed = ct.startswith("text/event-stream") or (
        "content-length" not in conn.headers and conn.headers.get("transfer-encoding", "").lower() == "chunked"
        and not ct.startswith("application/json"))
    try:
        if status < 200 or status > 599:  # no final HTTP answer (1xx, or past 599): the engine failed
            raise UpstreamError(f"the engine answered with an invalid HTTP status ({status})", received=True)
        if streamed:
            resp.start(status, content_type=ct, headers=headers)
            first = True
            while True:
                await conn.wait_body()
                if conn.chunks:
                    data = conn.take()
                    if first:
                        first = False
                        out.first_byte_at = time.monotonic()
                        if on_first_byte is not None:
                            on_first_byte()
                    out.events += data.count(_DATA)
                    at = data.find(b'data: {"error"')  # find: `in` on bytes raises and clears a TypeError
                    if at >= 0:  # the engine's own error event (e.g. out of memory)
                        out.engine_failed = True
                        out.error_text = data[at:][:2000].decode("utf-8", "replace")
                    resp.write_nowait(data)
                    if resp.paused:
                        conn.pause()
                        await resp.write(b"")   # waits until the client drained
                        conn.resume()
                if conn.error is not None:
                    out.engine_failed = True
                    out.error_text = str(conn.error)
                    if ct.startswith("text/event-stream"):
                        resp.write_nowait(stream_error_event(
                            f"The engine failed during streaming: {conn.error}", 500))
                    resp.end()
                    return out
                if conn.done:
                    resp.end()
                    break
        else:
            parts = []
            while True:
                await conn.wait_body()
                if conn.chunks:  # no first-byte callback: a whole answer says nothing of TTFT
                    parts.append(conn.take())
                if conn.error is not None:
                    out.engine_failed = True
                    out.error_text = str(conn.error)
                    raise conn.error
                if conn.done:
                    break
            out.body = body = b"".join(parts)
            if send_body:
                resp.send(status, body, content_type=ct, headers=headers)
    except BaseException:
        conn.abort()
        raise
    finally:
        pool.release(conn)
    out.ok = 200 <= status < 300 and not out.engine_failed
    if not out.ok and out.error_text is None and status >= 400:
        body = out.body
        out.error_text = body[:2000].decode("utf-8", "replace") if body else f"engine status {status}"
    return out
