"""A fast fixed-response HTTP/1.1 server: the "infinitely fast engine" for benchmarks.

Every request gets the same small non-streaming chat completion. With
``--stream-chunks N``, a request whose body asks for ``"stream": true`` gets instead a
fixed SSE stream: a role chunk, N one-token content chunks (``--chunk-interval-ms``
apart), a usage chunk and ``[DONE]``, framed as vLLM frames it.

It is a raw uvloop Protocol with httptools parsing and keep-alive, so that it costs
far less per request than anything measured against it (the loadgen's throughput
test, the gateway's overhead benchmark). Usage::

    python -m bench.upstream_fixed --port 0 [--stream-chunks 8] [--chunk-interval-ms 2]

It prints ``listening on 127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import httptools
import orjson

BODY = orjson.dumps(
    {
        "id": "chatcmpl-fixed",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "fixed",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2},
    }
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(obj) -> bytes:
    data = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_events(n: int) -> list[bytes]:
    """The chunked-encoded SSE pieces of one streamed answer, in order."""
    base = {"id": "chatcmpl-fixed", "object": "chat.completion.chunk", "created": 1700000000, "model": "fixed"}
    out = [
        _chunk(
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        )
    ]
    for i in range(n):
        out.append(
            _chunk(
                {
                    **base,
                    "choices": [
                        {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": "length" if i == n - 1 else None}
                    ],
                }
            )
        )
    out.append(
        _chunk({**base, "choices": [], "usage": {"prompt_tokens": 10, "total_tokens": 10 + n, "completion_tokens": n}})
    )
    out.append(_chunk(b"[DONE]") + b"0\r\n\r\n")
    return out


class FixedProtocol(asyncio.Protocol):
    """Parses requests and answers each at once (or as a timed stream)."""

    stream_pieces: list[bytes] = []
    interval = 0.0

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.streaming_req = False
        self.queue: list[bool] = []  # pipelined requests waiting behind a stream
        self.busy = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()

    def on_message_begin(self) -> None:
        self.streaming_req = False

    def on_body(self, body: bytes) -> None:
        if self.stream_pieces and (b'"stream":true' in body or b'"stream": true' in body):
            self.streaming_req = True

    def on_message_complete(self) -> None:
        self.queue.append(self.streaming_req)
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while self.queue and self.transport is not None:
            if not self.queue.pop(0):
                self.transport.write(RESPONSE)
                continue
            self.busy = True
            self._stream(0)
            return
        self.busy = False

    def _stream(self, i: int) -> None:
        if self.transport is None:
            return
        if i == 0:
            self.transport.write(STREAM_HEAD)
        pieces = self.stream_pieces
        if self.interval <= 0:
            self.transport.write(b"".join(pieces))
            self._next()
            return
        self.transport.write(pieces[i])
        if i + 1 < len(pieces):
            asyncio.get_running_loop().call_later(self.interval, self._stream, i + 1)
        else:
            self._next()


async def serve(host: str, port: int, stream_chunks: int, interval_ms: float) -> None:
    """Run until SIGTERM/SIGINT."""
    FixedProtocol.stream_pieces = stream_events(stream_chunks) if stream_chunks > 0 else []
    FixedProtocol.interval = interval_ms / 1000.0
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FixedProtocol, host, port, backlog=4096)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    print(f"listening on {host}:{server.sockets[0].getsockname()[1]}", flush=True)
    await stop
    server.close()
    await server.wait_closed()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument(
        "--stream-chunks", type=int, default=0, help="answer stream:true requests with this many SSE token chunks"
    )
    p.add_argument("--chunk-interval-ms", type=float, default=0.0, help="pause between stream chunks")
    a = p.parse_args(argv)
    # Each large body becomes a bytes object of its size: with glibc's defaults every one
    # was mapped and unmapped, and at 256 KiB bodies this server spent most of its core on
    # page faults and became the overhead benchmark's limit instead of the proxy it feeds.
    from velocity_fast.server.heap import keep_freed_memory

    keep_freed_memory()
    try:
        import uvloop

        uvloop.run(serve(a.host, a.port, a.stream_chunks, a.chunk_interval_ms))
    except ImportError:
        asyncio.run(serve(a.host, a.port, a.stream_chunks, a.chunk_interval_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
