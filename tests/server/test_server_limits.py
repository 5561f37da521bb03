"""Server limits and bad input on real sockets: each answer has its status code and
the error shape, its connection closes, and the server goes on serving the other
connections open at the time and new ones (velocity_fast/server/connection.pyx)."""

from __future__ import annotations

import asyncio
import time

from tests.support.server_wire import assert_error_shape, build, connect, echo, serving, still_serving

# Small limits so that each test runs in a fraction of a second.
# An idle connection opened first stands by through each test: its first byte may wait
# (tests/reliability/test_first_byte.py holds that timeout).
LIMITS = dict(
    max_body_bytes=1000,
    max_header_bytes=2048,
    header_timeout=0.2,
    body_timeout=0.2,
    keepalive_timeout=5.0,
    first_byte_timeout=5.0,
)


async def test_body_over_the_limit_by_content_length_is_413():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        assert (await other.request("GET", "/warm")).status == 200
        # The whole body comes with the head, as clients that do not wait for 100 send it.
        c.send(build("POST", "/big", b"x" * 5000))
        err = assert_error_shape(await c.response(), 413)
        assert "1000" in err["message"]
        assert await c.closed()
        await still_serving(srv, other)


async def test_the_413_reaches_a_client_still_sending_a_large_body():
    # Closing a socket with unread input makes the kernel send a reset that can
    # destroy the answer before the client reads it; the server lingers instead.
    async with serving(echo, **LIMITS) as srv:
        for _ in range(3):
            async with connect(srv) as c:
                c.send(build("POST", "/big", b"x" * 4_000_000))
                assert_error_shape(await c.response(), 413)
                assert await c.closed()
        await still_serving(srv)


async def test_413_by_content_length_comes_instead_of_100_continue():
    async with serving(echo, **LIMITS) as srv, connect(srv) as c:
        c.send(build("POST", "/big", None, {"Expect": "100-continue", "Content-Length": "5000"}))
        r = await c.response()
        assert r.interim == []
        assert_error_shape(r, 413)
        assert await c.closed()
        await still_serving(srv)


async def test_chunked_body_that_grows_past_the_limit_is_413():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        c.send(b"POST /grow HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            c.send(b"12c\r\n" + b"y" * 300 + b"\r\n")  # 900 bytes: still under the limit
        await asyncio.sleep(0.05)
        assert await c.closed(timeout=0.05) is False
        for _ in range(20):  # the client goes on sending after the answer: it must still read it
            c.send(b"12c\r\n" + b"y" * 300 + b"\r\n")
        assert_error_shape(await c.response(), 413)
        assert await c.closed()
        await still_serving(srv, other)


async def test_headers_over_the_limit_are_431():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        c.send(build("GET", "/h", None, {f"X-H{i}": "v" * 100 for i in range(40)}))
        assert_error_shape(await c.response(), 431)
        assert await c.closed()
        await still_serving(srv, other)


async def test_one_header_line_that_never_ends_is_431_before_it_ends():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        c.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Endless: ")
        for _ in range(10):
            c.send(b"z" * 1000)
            await c.writer.drain()
            await asyncio.sleep(0.01)
        assert_error_shape(await c.response(), 431)
        assert await c.closed()
        await still_serving(srv, other)


async def test_a_url_over_the_limit_is_431():
    async with serving(echo, **LIMITS) as srv, connect(srv) as c:
        c.send(build("GET", "/" + "u" * 4000))
        assert_error_shape(await c.response(), 431)
        assert await c.closed()
        await still_serving(srv)


async def test_slow_head_is_408():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        t0 = time.monotonic()
        c.send(b"GET /slow HTTP/1.1\r\nHost: t\r\n")  # the blank line never comes
        err = assert_error_shape(await c.response(), 408)
        assert "head" in err["message"]
        assert time.monotonic() - t0 >= 0.2 * 0.5  # not before the timeout
        assert await c.closed()
        await still_serving(srv, other)


async def test_slow_body_is_408():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        c.send(build("POST", "/slow", None, {"Content-Length": "100"}) + b"only ten b")
        err = assert_error_shape(await c.response(), 408)
        assert "body" in err["message"]
        assert await c.closed()
        await still_serving(srv, other)


async def test_a_body_trickling_in_within_the_timeout_is_not_408():
    async with serving(echo, **LIMITS) as srv, connect(srv) as c:
        c.send(build("POST", "/t", None, {"Content-Length": "4"}))
        for b in (b"a", b"b", b"c", b"d"):
            await asyncio.sleep(0.02)
            c.send(b)
        assert (await c.response()).json()["body"] == "abcd"


async def test_a_body_split_across_reads_then_pipelined_requests_in_its_last_read():
    """A whole head with part of its body is taken at once and its body filled in as it
    comes (no llhttp): the requests that follow in the read that ends it are answered
    too, in order, each with its own body."""
    async with serving(echo, **LIMITS) as srv, connect(srv) as c:
        first = build("POST", "/one", b"a" * 600)
        c.send(first[:-550])  # the head and 50 bytes of the body
        await asyncio.sleep(0.03)
        c.send(first[-550:-300])
        await asyncio.sleep(0.03)
        c.send(first[-300:] + build("POST", "/two", b"b" * 10) + build("POST", "/three", b"c" * 700)[:-100])
        await asyncio.sleep(0.03)
        c.send(build("POST", "/three", b"c" * 700)[-100:])
        got = [(await c.response()).json() for _ in range(3)]
        assert [(g["path"], g["body"]) for g in got] == [("/one", "a" * 600), ("/two", "b" * 10), ("/three", "c" * 700)]
        assert (await c.request("GET", "/after")).status == 200


async def test_idle_keep_alive_connection_is_closed_after_the_timeout():
    limits = dict(LIMITS, keepalive_timeout=0.2)
    async with serving(echo, **limits) as srv, connect(srv) as c:
        assert (await c.request("GET", "/once")).status == 200
        t0 = time.monotonic()
        assert await c.closed()
        assert time.monotonic() - t0 >= 0.2 * 0.5
        await still_serving(srv)


async def test_a_connection_that_never_sends_is_closed_after_the_idle_timeout():
    limits = dict(LIMITS, keepalive_timeout=0.2, first_byte_timeout=0.2)
    async with serving(echo, **limits) as srv, connect(srv) as c:
        assert await c.closed()
        await still_serving(srv)


async def test_an_idle_timeout_longer_than_the_read_timeouts_is_kept():
    limits = dict(LIMITS, header_timeout=0.1, body_timeout=0.1, keepalive_timeout=0.5)
    async with serving(echo, **limits) as srv, connect(srv) as c:
        assert (await c.request("GET", "/once")).status == 200
        t0 = time.monotonic()
        assert await c.closed()
        assert time.monotonic() - t0 >= 0.5 * 0.5  # not at the shorter read timeout


async def test_the_head_timeout_counts_from_the_head_not_from_the_idle_start():
    limits = dict(LIMITS, header_timeout=0.3, keepalive_timeout=5.0)
    async with serving(echo, **limits) as srv, connect(srv) as c:
        assert (await c.request("GET", "/once")).status == 200
        await asyncio.sleep(0.2)  # idle for a while first
        t0 = time.monotonic()
        c.send(b"GET /slow HTTP/1.1\r\n")
        assert_error_shape(await c.response(), 408)
        assert time.monotonic() - t0 >= 0.3 * 0.5


async def test_no_408_while_the_server_itself_stopped_reading_a_full_pipeline():
    async def handler(req, resp):
        await asyncio.sleep(0.15)  # each answer takes longer than the read timeouts
        await echo(req, resp)

    limits = dict(LIMITS, header_timeout=0.05, body_timeout=0.05, max_pipelined=2)
    async with serving(handler, **limits) as srv, connect(srv) as c:
        fourth = build("POST", "/3", b"four")
        # Three requests fill the queue (reading pauses) and the fourth head begins in
        # the same read; its rest waits in the socket until the queue drains.
        c.send(build("GET", "/0") + build("GET", "/1") + build("GET", "/2") + fourth[:12])
        await asyncio.sleep(0.05)
        c.send(fourth[12:])
        paths = [(await c.response()).json()["path"] for _ in range(4)]
        assert paths == ["/0", "/1", "/2", "/3"]


async def test_a_connection_in_use_is_not_closed_by_the_idle_timeout():
    limits = dict(LIMITS, keepalive_timeout=0.1)

    async def handler(req, resp):
        await asyncio.sleep(0.3)  # longer than the idle timeout
        await echo(req, resp)

    async with serving(handler, **limits) as srv, connect(srv) as c:
        for i in range(2):
            assert (await c.request("GET", f"/{i}")).json()["path"] == f"/{i}"
            await asyncio.sleep(0.03)


async def test_malformed_request_is_400_in_the_error_shape_and_closes():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other, connect(srv) as c:
        assert (await other.request("GET", "/warm")).status == 200
        c.send(b"THIS IS NOT HTTP\r\n\r\n")
        err = assert_error_shape(await c.response(), 400)
        assert err["type"] == "BadRequestError"
        assert await c.closed()
        await still_serving(srv, other)


async def test_bad_framing_is_400():
    bad = [
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET / HTTP/1.1\r\nBad Header Name: x\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
    ]
    async with serving(echo, **LIMITS) as srv:
        for raw in bad:
            async with connect(srv) as c:
                c.send(raw)
                assert_error_shape(await c.response(), 400)
                assert await c.closed()
        await still_serving(srv)


async def test_requests_pipelined_ahead_of_a_bad_one_are_answered_then_the_400():
    release = asyncio.Event()

    async def handler(req, resp):
        if req.path == "/slow":
            await release.wait()
        await echo(req, resp)

    async with serving(handler, **LIMITS) as srv, connect(srv) as c:
        c.send(build("GET", "/slow") + build("POST", "/second", b"2") + b"GARBAGE\r\n\r\n" + build("GET", "/never"))
        await asyncio.sleep(0.05)
        release.set()
        first, second = await c.response(), await c.response()
        assert first.json()["path"] == "/slow" and second.json()["path"] == "/second"
        assert_error_shape(await c.response(), 400)
        assert await c.closed()  # /never, after the bad bytes, is not answered
        await still_serving(srv)


async def test_a_body_over_the_limit_behind_a_pending_response_waits_its_turn():
    release = asyncio.Event()

    async def handler(req, resp):
        await release.wait()
        await echo(req, resp)

    async with serving(handler, **LIMITS) as srv, connect(srv) as c:
        c.send(build("GET", "/first") + build("POST", "/big", b"x" * 5000))
        await asyncio.sleep(0.05)
        release.set()
        assert (await c.response()).json()["path"] == "/first"
        assert_error_shape(await c.response(), 413)
        assert await c.closed()


async def test_connect_is_405():
    async with serving(echo, **LIMITS) as srv, connect(srv) as c:
        c.send(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        assert_error_shape(await c.response(), 405)
        assert await c.closed()
        await still_serving(srv)


async def test_an_upgrade_request_with_a_body_is_400():
    # llhttp does not read such a body; parsed on, it could smuggle a request.
    async with serving(echo, **LIMITS) as srv, connect(srv) as c:
        c.send(build("POST", "/u", build("GET", "/smuggled"), {"Connection": "Upgrade", "Upgrade": "h2c"}))
        assert_error_shape(await c.response(), 400)
        assert await c.closed()
        await still_serving(srv)


async def test_many_bad_connections_at_once_leave_the_good_ones_alone():
    async with serving(echo, **LIMITS) as srv, connect(srv) as other:

        async def bad(i: int) -> int:
            async with connect(srv) as c:
                c.send(b"\x00\x01garbage %d\r\n\r\n" % i)
                return (await c.response()).status

        statuses = await asyncio.gather(*(bad(i) for i in range(20)))
        assert statuses == [400] * 20
        assert srv.errors >= 20
        await still_serving(srv, other)
