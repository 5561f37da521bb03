"""The reliability suite's harness: a gateway process in front of sim engines with short
read timeouts (bench/lib/stack.py's), and a fake engine that answers with faults. The raw
client, the seeded case generators (request heads, JSON bodies) and /metrics are
bench/lib/hostile.py's, which bench/reliability.py runs too; they are re-exported here.

Everything listens on 127.0.0.1; every process started here is stopped by the context
manager that started it.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from bench.lib.hostile import (  # noqa: F401  (re-exported: the tests use them as h.NAME)
    FIELDS,
    HANG_S,
    MODEL,
    READ_TIMEOUT_S,
    ROUTES,
    Outcome,
    Tally,
    _by_hand,
    body_case,
    body_cases,
    config_yaml,
    exchange,
    head_cases,
    metrics,
    mutate_head,
    odd_value,
    request_bytes,
    run_cases,
    seed_heads,
    served,
    total,
    valid_body,
)
from bench.lib.stack import Stack, gateway_stack  # noqa: F401  (re-exported: h.gateway_stack, h.Stack)
from tests.support.gateway import ScriptedServer

# -- the engine side: a fake engine that answers each request with one fault --------------------

FAULTS = (
    "garbage_head",
    "almost_http",
    "truncated_chunked",
    "malformed_sse",
    "invalid_json_200",
    "short_body",
    "close_at_once",
    "bad_chunk_size",
    "huge_header",
    "odd_status",
    "bare_lf_head",
    "valid",
)


def fault_answer(kind: str, rng: random.Random, stream: bool) -> bytes:
    """The bytes a faulty engine sends for one request (then it closes the connection,
    except after "valid")."""
    if kind == "garbage_head":
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
    if kind == "almost_http":
        return rng.choice(
            (
                b"HTTP/1.1 2OO OK\r\n\r\n",
                b"HTTP/1.1 200\r\ncontent-length: x\r\n\r\n",
                b"HTTP/2 200\r\n\r\n",
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nhello",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nabc",
            )
        )
    if kind == "truncated_chunked":
        ct = b"text/event-stream" if stream else b"application/json"
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: " + ct + b"\r\ntransfer-encoding: chunked\r\n\r\n"
            b"20\r\ndata: {\"choices\":[{\"text\":\"a\"}]}\n\n\r\n40\r\ndata: {\"cho"
        )
    if kind == "malformed_sse":
        events = rng.choice(
            (
                b"data: {not json\n\n",
                b"data: [DONE\n\n",
                b"event: x\n\n\n",
                b"data:" + b"x" * 5000,
                b"data: {\"error\": {\"message\": \"boom\"}}\n\n",
            )
        )
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(events)
            + events
            + b"\r\n0\r\n\r\n"
        )
    if kind == "invalid_json_200":
        body = rng.choice((b"{\"choices\": [", b"not json", b"", b"{\"choices\": []}", b"[]", b"{\"choices\": [1]}"))
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    if kind == "short_body":
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"id\": \"x\""
    if kind == "close_at_once":
        return b""
    if kind == "bad_chunk_size":
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            b"zz\r\ndata: x\n\n\r\n"
        )
    if kind == "huge_header":
        return b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 200_000 + b"\r\ncontent-length: 2\r\n\r\n{}"
    if kind == "odd_status":
        status = rng.choice((b"999", b"600", b"099", b"1000", b"-20", b"101", b"204", b"304"))
        return b"HTTP/1.1 " + status + b" Odd\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    if kind == "bare_lf_head":
        body = b"{\"id\":\"x\",\"object\":\"chat.completion\",\"choices\":[]}"
        return b"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: %d\n\n" % len(body) + body
    body = (
        b"{\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"ok\","
        b"\"message\":{\"role\":\"assistant\",\"content\":\"ok\"},\"finish_reason\":\"stop\"}],"
        b"\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2}}"
    )
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body


class FaultyEngine(ScriptedServer):
    """An engine on 127.0.0.1 whose /health and /metrics are sound and whose every other
    request gets the next fault of a seeded draw; ``served`` counts the faults by kind."""

    def __init__(self, seed: int = 0, kinds: tuple[str, ...] = FAULTS, answer: bytes | None = None) -> None:
        super().__init__()
        self.kinds = kinds
        self.answer = answer  # a fixed answer instead of the draw
        self.rng = random.Random(seed)
        self.served: Counter = Counter()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                n = 0
                for ln in lines[1:]:
                    if ln.lower().startswith("content-length:"):
                        n = int(ln.split(":", 1)[1])
                body = await reader.readexactly(n) if n else b""
                if path == "/health":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                if path == "/v1/models":  # the gateway's monitor asks once (the context length)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                if path == "/metrics":
                    m = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(m) + m
                    )
                    continue
                kind = self.rng.choice(self.kinds)
                self.served[kind] += 1
                writer.write(
                    self.answer
                    if self.answer is not None
                    else fault_answer(kind, self.rng, b'"stream":true' in body.replace(b" ", b""))
                )
                await writer.drain()
                if kind != "valid":
                    break
        except (asyncio.LimitOverrunError, IndexError, ValueError):
            pass  # a garbled request from the gateway ends the connection
