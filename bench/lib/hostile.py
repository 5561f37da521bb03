"""Hostile input against a gateway, what bench/reliability.py and the reliability tests
share: a raw client whose every wait is bounded, the seeded case generators (mutated
request heads, odd JSON bodies), a tally of the answers, and the gateway's /metrics.

Everything talks to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import httptools
import orjson
from prometheus_client.parser import text_string_to_metric_families

MODEL = "sim-model"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")

# Short read timeouts: a case that leaves a head or a body unfinished is settled (408 or a
# quiet close) within about a second, so the run never waits on the gateway's defaults.
READ_TIMEOUT_S = 1.0
# A case with no answer and no close past every timeout of the gateway is a hang.
HANG_S = 3 * READ_TIMEOUT_S + 3.0


def config_yaml(endpoints: list[tuple[str, str, str]], *, api_key: str | None = None, extra: str = "") -> str:
    lines = [
        "server:",
        f"  header_timeout_s: {READ_TIMEOUT_S}",
        f"  body_timeout_s: {READ_TIMEOUT_S}",
        f"  first_byte_timeout_s: {READ_TIMEOUT_S}",
        "  keepalive_timeout_s: 5.0",
        "health:",
        "  check_interval_ms: 200.0",
        "  scrape_interval_ms: 200.0",
        "  eject_base_ms: 200.0",
        "  eject_max_ms: 1000.0",
        "endpoints:",
    ]
    for name, url, model in endpoints:
        lines += [f"  - name: {name}", f"    url: {url}", f"    model: {model}"]
    if api_key:
        lines.append(f"api_key: {api_key}")
    return "\n".join(lines) + "\n" + extra


# -- the raw client ----------------------------------------------------------------------------


@dataclass
class Outcome:
    statuses: list[int] = field(default_factory=list)  # every complete answer, in order
    body: bytes = b""  # the first answer's body
    closed: bool = False  # the gateway closed (EOF or reset)
    hung: bool = False  # neither an answer nor a close within the wait
    headers: dict = field(default_factory=dict)  # the first answer's headers


class _Parser:
    def __init__(self) -> None:
        self.p = httptools.HttpResponseParser(self)
        self.statuses: list[int] = []
        self.body: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.done = 0
        self.broken = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.statuses:
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        if not self.statuses:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.statuses.append(self.p.get_status_code())
        self.done += 1

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self.p.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass
        except httptools.HttpParserError:
            self.broken = True


async def exchange(
    port: int, data: bytes, wait: float = HANG_S, settle: float = 0.15, chunks: list[bytes] | None = None
) -> Outcome:
    """Send ``data`` (or ``chunks`` one by one) on a new connection and read answers until the
    gateway closes it, or one answer came and nothing more arrives for ``settle`` seconds;
    ``hung`` when neither an answer nor a close comes within ``wait``."""
    out = Outcome()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5.0)
    parser = _Parser()
    try:
        try:
            for piece in chunks if chunks is not None else [data]:
                writer.write(piece)
                if chunks is not None:
                    await writer.drain()
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the gateway may refuse and close before it read everything: read its answer
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if parser.done:
                left = min(left, settle)
            if left <= 0:
                out.hung = not parser.done
                break
            try:
                got = await asyncio.wait_for(reader.read(65536), left)
            except asyncio.TimeoutError:
                out.hung = not parser.done
                break
            except (ConnectionError, OSError):
                out.closed = True
                break
            if not got:
                out.closed = True
                parser.feed(b"")  # (a close-delimited answer ends here)
                break
            parser.feed(got)
    finally:
        writer.transport.abort()
    out.statuses = parser.statuses
    out.body = b"".join(parser.body)
    out.headers = parser.headers
    return out


def request_bytes(
    method: str, path: str, body: bytes | None = None, headers: dict | None = None, close: bool = True
) -> bytes:
    h = {"host": "127.0.0.1", "content-type": "application/json"}
    if body is not None:
        h["content-length"] = str(len(body))
    if close:
        h["connection"] = "close"
    h.update(headers or {})
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode(
        "latin-1"
    ) + (body or b"")


def valid_body(route: str, max_tokens: int = 4) -> bytes:
    if route == "/v1/chat/completions":
        return orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": max_tokens}
        )
    if route == "/v1/completions":
        return orjson.dumps({"model": MODEL, "prompt": "ping", "max_tokens": max_tokens})
    return orjson.dumps({"prompt": "ping", "max_tokens": max_tokens})


async def served(port: int) -> bool:
    """A valid request on each route answers 200."""
    for route in ROUTES:
        out = await exchange(port, request_bytes("POST", route, valid_body(route)), 10.0)
        if out.statuses != [200]:
            return False
    return True


async def metrics(admin_port: int) -> dict[str, dict[tuple, float]]:
    """The gateway's /metrics: {sample name: {sorted label items: value}}."""
    out = await exchange(admin_port, request_bytes("GET", "/metrics", None), 10.0)
    samples: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(out.body.decode()):
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    return sum(v for k, v in samples.get(name, {}).items() if all(dict(k).get(a) == b for a, b in labels.items()))


# -- request heads: a seeded mutational loop --------------------------------------------------


def seed_heads() -> list[bytes]:
    """Well-formed requests the mutations start from (each route, bodies, pipelining)."""
    out = []
    for route in ROUTES:
        out.append(request_bytes("POST", route, valid_body(route)))
        out.append(request_bytes("POST", route, valid_body(route), close=False))
    out.append(request_bytes("GET", "/health", None))
    out.append(request_bytes("GET", "/v1/models", None))
    body = valid_body("/v1/completions")
    out.append(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n\r\n"
    )
    out.append(request_bytes("GET", "/health", None, close=False) * 2)
    return out


_TOKENS = [
    b"\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b" ",
    b":",
    b"\t",
    b"content-length: 5\r\n",
    b"content-length: -1\r\n",
    b"content-length: 99999999999999999999\r\n",
    b"content-length: 1, 2\r\n",
    b"transfer-encoding: chunked\r\n",
    b"transfer-encoding: gzip, chunked\r\n",
    b"expect: 100-continue\r\n",
    b"connection: upgrade\r\nupgrade: h2c\r\n",
    b"HTTP/1.0",
    b"HTTP/9.9",
    b"GET ",
    b"CONNECT ",
    b"\xff\xfe",
    b"x-request-id: \x01\r\n",
    b"x-velocity-sla-ms: nan\r\n",
    b"x-velocity-sla-ms: 1e999\r\n",
    b"x-velocity-priority: 99999999999999999999\r\n",
    b"x-velocity-tenant: \xc3\x28\r\n",
    b"authorization: Bearer \r\n",
    b"0\r\n\r\n",
    b"ffffffffffffffff\r\n",
]


def mutate_head(rng: random.Random, base: bytes) -> bytes:
    """One to four mutations of ``base``: byte flips, cuts, inserted tokens, duplicated or
    dropped spans, huge lines, conflicting framing, pipelined garbage."""
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(11)
        n = len(data)
        at = rng.randrange(n + 1) if n else 0
        if kind == 0 and n:  # flip a byte
            data[rng.randrange(n)] = rng.randrange(256)
        elif kind == 1:  # truncate
            del data[at:]
        elif kind == 2:  # insert a token
            data[at:at] = rng.choice(_TOKENS)
        elif kind == 3 and n:  # duplicate a span
            j = min(n, at + rng.randint(1, 64))
            data[at:at] = data[at:j]
        elif kind == 4 and n:  # drop a span
            del data[at : at + rng.randint(1, 32)]
        elif kind == 5:  # a huge line
            data[at:at] = b"x-big: " + b"a" * rng.choice((100, 5000, 70000)) + b"\r\n"
        elif kind == 6:  # bare LF for CRLF
            data[:] = bytes(data).replace(b"\r\n", b"\n", rng.randint(1, 4))
        elif kind == 7:  # a second, conflicting framing header after the request line
            line_end = data.find(b"\r\n")
            if line_end >= 0:
                data[line_end + 2 : line_end + 2] = rng.choice(_TOKENS[7:13])
        elif kind == 8:  # pipelined garbage
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        elif kind == 9:  # random bytes replace a span
            j = min(n, at + rng.randint(1, 16))
            data[at:j] = bytes(rng.randrange(256) for _ in range(j - at))
        else:  # NULs
            data[at:at] = b"\x00" * rng.randint(1, 3)
    return bytes(data)


def head_cases(seed: int, count: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    bases = seed_heads()
    for _ in range(count):
        yield mutate_head(rng, rng.choice(bases))


# -- JSON bodies: seeded, every field of every route ----------------------------------------

FIELDS = {
    "/v1/chat/completions": (
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "priority",
        "sla_ms",
        "user",
        "temperature",
        "n",
        "stop",
        "seed",
    ),
    "/v1/completions": (
        "model",
        "prompt",
        "stream",
        "stream_options",
        "max_tokens",
        "priority",
        "sla_ms",
        "user",
        "temperature",
        "echo",
        "logprobs",
    ),
    "/generate": ("prompt", "max_tokens", "priority", "sla_ms", "stream", "model", "temperature"),
}


def odd_value(rng: random.Random, depth: int = 0):
    """A JSON value of any type, often an awkward one."""
    k = rng.randrange(16)
    if k == 0:
        return None
    if k == 1:
        return rng.choice((True, False))
    if k == 2:
        return rng.choice(
            (0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40, -(10**40))
        )
    if k == 3:
        return rng.choice((0.0, -0.5, 1.5, 1e308, -1e308, 5e-324, 1e-7))
    if k == 4:
        return rng.choice(
            (
                "",
                "x",
                "normal",
                "high",
                "HIGH ",
                "\u0000",
                "\ud7ff\ue000",
                "é" * 50,
                "1e999",
                "nan",
                "-1",
                MODEL,
                "no-such-model",
            )
        )
    if k == 5 and depth < 4:
        return [odd_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if k == 6 and depth < 4:
        return {
            rng.choice(("a", "type", "text", "role", "content", "include_usage")): odd_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))
        }
    if k == 7:
        return [
            {
                "role": rng.choice(("user", "system", "assistant", "tool", "x")),
                "content": rng.choice(
                    (
                        "hi",
                        "",
                        None,
                        [{"type": "text", "text": "hi"}],
                        [{"type": "image_url", "image_url": {"url": "data:,"}}],
                        5,
                    )
                ),
            }
        ]
    if k == 8:
        return {"include_usage": rng.choice((True, False, None, "yes", 1))}
    return rng.choice(("hi", 4, True, None, [], {}))


_RAW_TOKENS = [
    b"[" * 1200 + b"]" * 1200,
    b"{\"a\":" * 1100 + b"1" + b"}" * 1100,
    b"1e999",
    b"-1e999",
    b"123456789012345678901234567890",
    b"NaN",
    b"Infinity",
    b"\"\\ud800\"",
    b"\"\xff\xfe\"",
    b"\"\xc3\x28\"",
    b"00012",
    b"1.",
    b".5",
    b"+1",
    b"\"\\u0000\"",
    b"tru",
    b"nul",
]


def body_case(rng: random.Random, route: str) -> bytes:
    """One body for ``route``: valid, or with a field of the wrong type, out of range,
    nested deep, invalid UTF-8, duplicated keys, or the JSON itself cut or mutated."""
    obj = orjson.loads(valid_body(route))
    fields = FIELDS[route]
    kind = rng.randrange(10)
    if kind <= 3:  # wrong or awkward values for one to three fields
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(fields)
            if rng.random() < 0.15:
                obj.pop(name, None)
            else:
                obj[name] = odd_value(rng)
        if obj.get("stream") is True and rng.random() < 0.7:
            obj["stream"] = False  # mostly whole answers: quicker, and streams are covered too
        try:
            return orjson.dumps(obj)
        except (TypeError, orjson.JSONEncodeError):  # an int past 64 bits: written by hand
            return _by_hand(obj)
    if kind == 4:  # a raw token in place of a field's value
        name = rng.choice(fields)
        obj[name] = "\x00SLOT\x00"
        return orjson.dumps(obj).replace(b'"\\u0000SLOT\\u0000"', rng.choice(_RAW_TOKENS))
    if kind == 5:  # duplicate keys, the last one odd
        name = rng.choice(fields)
        text = orjson.dumps(obj)
        extra = b'"%s":%s,' % (name.encode(), _by_hand(odd_value(rng)))
        return text[:1] + extra + text[1:]
    if kind == 6:  # OpenAI's content parts: valid, must be answered 200
        if route == "/v1/chat/completions":
            obj["messages"] = [{"role": "user", "content": [{"type": "text", "text": "ping"}]}]
        return orjson.dumps(obj)
    if kind == 7:  # cut or byte-mutated JSON
        data = bytearray(orjson.dumps(obj))
        if rng.random() < 0.5:
            del data[rng.randrange(len(data)) :]
        else:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 8:  # not an object at all
        return rng.choice((b"[]", b"null", b"1", b"\"x\"", b"", b" ", b"{}", b"[" * 2000, b"{" * 3000))
    return orjson.dumps(obj)  # valid


def _by_hand(v) -> bytes:
    """JSON for values orjson refuses (integers past 64 bits)."""
    if isinstance(v, bool) or v is None:
        return orjson.dumps(v)
    if isinstance(v, int):
        return str(v).encode()
    if isinstance(v, list):
        return b"[" + b",".join(_by_hand(x) for x in v) + b"]"
    if isinstance(v, dict):
        return b"{" + b",".join(orjson.dumps(k) + b":" + _by_hand(x) for k, x in v.items()) + b"}"
    return orjson.dumps(v)


def body_cases(seed: int, count: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    for _ in range(count):
        route = rng.choice(ROUTES)
        yield route, body_case(rng, route)


@dataclass
class Tally:
    """What a batch of cases got back."""

    statuses: Counter = field(default_factory=Counter)
    hangs: int = 0
    closed_without_answer: int = 0
    cases: int = 0
    five_hundreds: list = field(default_factory=list)  # (case, answer) of each 500, the first few

    def add(self, case, out: Outcome) -> None:
        self.cases += 1
        for s in out.statuses:
            self.statuses[s] += 1
            if s == 500 and len(self.five_hundreds) < 5:
                self.five_hundreds.append((case, out.body[:300]))
        if out.hung:
            self.hangs += 1
        elif not out.statuses:
            self.closed_without_answer += 1

    @property
    def n500(self) -> int:
        return self.statuses.get(500, 0)


async def run_cases(port: int, cases, tally: Tally, concurrency: int = 32) -> None:
    """Each case (raw bytes, or (route, body)) on its own connection, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(case):
        async with sem:
            if isinstance(case, tuple):
                route, body = case
                data = request_bytes("POST", route, body)
            else:
                data = case
            try:
                out = await exchange(port, data)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                out = Outcome(closed=True)
            tally.add(case, out)

    pending: set[asyncio.Task] = set()
    for case in cases:
        if len(pending) >= concurrency * 4:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        pending.add(asyncio.ensure_future(one(case)))
    if pending:
        await asyncio.wait(pending)
