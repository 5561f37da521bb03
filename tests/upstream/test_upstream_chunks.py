"""The engine connection's own reading of chunked streams (upstream/connection.pyx), against llhttp.

A stream's whole chunks go on to the client as they came (``on_raw``); a chunk split
across reads goes as its pieces of data (``on_body``, framed anew by the Responder).
Whatever the reads, the client must get whole chunks carrying exactly the engine's data,
and the answer must end once, where llhttp says it ends. Framing llhttp refuses must fail
the request, not pass on.
"""

from __future__ import annotations

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.http.http1 import scan_chunked_head
from velocity_fast.upstream.connection import ResponseHandler, UpstreamConnection
from velocity_fast.upstream.errors import UpstreamError

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"date: Sun, 29 Nov 2026 22:00:00 GMT\r\n\r\n"
)


class _Pool:
    def __init__(self) -> None:
        self.forgotten = 0

    def forget(self, conn) -> None:
        self.forgotten += 1


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Relay(ResponseHandler):
    """Frames what it is given as a chunked Responder would: the client's bytes."""

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.out = bytearray()
        self.pieces: list[tuple[str, bytes]] = []
        self.done = 0
        self.errors: list[UpstreamError] = []

    def on_head(self, conn) -> None:
        self.relaying = True
        self.raw_chunks = self.raw

    def on_raw(self, conn, framed: bytes) -> None:
        self.pieces.append(("raw", framed))
        self.out += framed

    def on_body(self, conn, data: bytes) -> None:
        assert data, "an empty piece would end the client's stream"
        self.pieces.append(("body", data))
        self.out += b"%x\r\n%s\r\n" % (len(data), data)

    def on_done(self, conn) -> None:
        self.done += 1

    def on_error(self, conn, err) -> None:
        self.errors.append(err)


def _dechunk(data: bytes) -> tuple[list[bytes], int]:
    """Strict reader of a chunk sequence without its last chunk: (chunks, bytes read)."""
    chunks, pos = [], 0
    while pos < len(data):
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0].strip(), 16)
        assert size > 0
        chunks.append(data[eol + 2 : eol + 2 + size])
        assert data[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size
    return chunks, pos


def _llhttp_body(wire: bytes) -> tuple[bytes, bool]:
    class P:
        body = b""
        complete = False

        def on_body(self, b):
            P.body += b

        def on_message_complete(self):
            P.complete = True

    httptools.HttpResponseParser(P()).feed_data(wire)
    return P.body, P.complete


def _conn(handler) -> tuple[UpstreamConnection, _Transport]:
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        conn = UpstreamConnection(_Pool(), loop)
    finally:
        loop.close()
    t = _Transport()
    conn.connection_made(t)
    conn.handler = handler  # as send_to leaves it
    return conn, t


def _wire(chunks: list[bytes], ext: bool, trailers: bool) -> bytes:
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(c), b";x=1" if ext else b"", c) for c in chunks)
    return HEAD + body + b"0\r\n" + (b"x-trailer: 1\r\n" if trailers else b"") + b"\r\n"


def _feed(conn, wire: bytes, cuts: list[int]) -> None:
    last = 0
    for c in sorted(set(cuts)) + [len(wire)]:
        if c > last:
            conn.data_received(wire[last:c])
            last = c


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(min_value=len(HEAD) + 1, max_value=400), max_size=6),
    raw=st.booleans(),
    ext=st.booleans(),
    trailers=st.booleans(),
)
def test_any_reads_give_the_client_whole_chunks_with_the_engines_data(chunks, cuts, raw, ext, trailers):
    wire = _wire(chunks, ext, trailers)
    relay = _Relay(raw)
    conn, t = _conn(relay)
    _feed(conn, wire, [0 if c > len(wire) else c for c in cuts])
    got, used = _dechunk(bytes(relay.out))
    assert used == len(relay.out)
    assert b"".join(got) == b"".join(chunks) == _llhttp_body(wire)[0]
    assert relay.done == 1 and not relay.errors and conn.done and not t.closed
    if not raw:
        assert all(kind == "body" for kind, _ in relay.pieces)
    # every raw piece is whole chunks, as the engine framed them
    for kind, piece in relay.pieces:
        if kind == "raw":
            assert _dechunk(piece)[1] == len(piece)


def test_whole_chunks_in_one_read_pass_on_unchanged_in_one_piece():
    events = [b"data: {\"i\": %d}\n\n" % i for i in range(5)]
    wire = _wire(events, False, False)
    relay = _Relay(True)
    conn, _ = _conn(relay)
    conn.data_received(wire)
    assert relay.pieces == [("raw", wire[len(HEAD) : -len(b"0\r\n\r\n")])]
    assert relay.done == 1 and conn.status == 200 and conn.headers["transfer-encoding"] == "chunked"


def test_a_chunk_split_across_reads_goes_as_data_and_the_rest_stays_whole():
    wire = _wire([b"a" * 10, b"b" * 10, b"c" * 10], False, False)
    cut = wire.index(b"b" * 10) + 4
    relay = _Relay(True)
    conn, _ = _conn(relay)
    conn.data_received(wire[:cut])
    conn.data_received(wire[cut:])
    assert relay.pieces == [
        ("raw", b"a\r\n" + b"a" * 10 + b"\r\n"),
        ("body", b"bbbb"),
        ("body", b"b" * 6),
        ("raw", b"a\r\n" + b"c" * 10 + b"\r\n"),
    ]
    assert relay.done == 1


@pytest.mark.parametrize(
    "bad", [b"zz\r\nab\r\n", b"2\r\nabc\r\n", b"2\nab\r\n", b"\r\n", b"2\r\nab\n\n", b"10000000000000000\r\n"]
)
def test_bad_framing_fails_the_request_and_closes_the_connection(bad):
    relay = _Relay(True)
    conn, t = _conn(relay)
    conn.data_received(HEAD + bad)
    assert len(relay.errors) == 1 and relay.errors[0].received and relay.done == 0
    assert t.closed and not conn.done
    with pytest.raises(httptools.HttpParserError):
        httptools.HttpResponseParser(_Relay(True)).feed_data(HEAD + bad + b"0\r\n\r\n")


def test_engine_closing_inside_a_chunk_fails_after_the_whole_chunks_went_on():
    wire = _wire([b"x" * 8, b"y" * 8], False, False)
    relay = _Relay(True)
    conn, _ = _conn(relay)
    conn.data_received(wire[: wire.index(b"y" * 8) + 3])
    conn.connection_lost(None)
    assert [k for k, _ in relay.pieces] == ["raw", "body"]
    assert len(relay.errors) == 1 and relay.errors[0].received
    # what the client got is still whole chunks: the error event can follow
    assert _dechunk(bytes(relay.out))[1] == len(relay.out)


def test_only_a_chunked_head_is_read_here():
    assert scan_chunked_head(HEAD, 0) == (
        200,
        {"content-type": "text/event-stream", "transfer-encoding": "chunked", "date": "Sun, 29 Nov 2026 22:00:00 GMT"},
        True,
        len(HEAD),
    )
    both = HEAD.replace(b"\r\n\r\n", b"\r\ncontent-length: 5\r\n\r\n")
    gzip = HEAD.replace(b"chunked", b"gzip, chunked")
    for other in (
        both,
        gzip,
        HEAD.replace(b"transfer-encoding: chunked\r\n", b"content-length: 0\r\n"),
        HEAD.replace(b"HTTP/1.1 200", b"HTTP/1.1 204"),
        HEAD[:-1],
    ):
        assert scan_chunked_head(other, 0) is None


class _Keep(ResponseHandler):
    def __init__(self) -> None:
        self.done = 0

    def on_done(self, conn) -> None:
        self.done += 1


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\ndate: x\r\nContent-Type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 503 Busy\r\ncontent-type: text/plain; charset=utf-8\r\nset-cookie: a\r\n"
        b"set-cookie: b\r\ncontent-length: 4\r\n\r\nbusy",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        HEAD + b"3\r\nabc\r\n0\r\n\r\n",
    ],
)
def test_a_head_read_whole_is_what_llhttp_reads_from_the_same_bytes_split(wire):
    # One read: the compiled scanner (headers made only when asked); split inside the
    # status line: llhttp's callbacks. The exchange reads these fields, not the dict.
    seen = []
    for cuts in ([], [5]):
        handler = _Keep()
        conn, _ = _conn(handler)
        _feed(conn, wire, cuts)
        assert handler.done == 1
        seen.append(
            (
                conn.status,
                conn.keep_alive,
                conn.content_type,
                conn.has_length,
                conn.te_chunked,
                dict(conn.headers),
                conn.take(),
            )
        )
    assert seen[0] == seen[1]
    status, _, ct, has_length, te_chunked, headers, _ = seen[0]
    assert ct == headers.get("content-type") and has_length == ("content-length" in headers)
    assert te_chunked == (headers.get("transfer-encoding") == "chunked")
