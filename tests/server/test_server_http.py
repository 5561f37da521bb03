"""HTTP/1.1 server core on real sockets: keep-alive, pipelining, request bodies,
100-continue, HTTP/1.0, HEAD and ignored upgrades (velocity_fast/server/connection.pyx)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.support.server_wire import build, chunked, connect, echo, serving


def _recorder():
    """A handler that keeps each request it gets and answers 200 "ok"."""
    seen = []

    async def handler(req, resp):
        seen.append(req)
        resp.send(200, b"ok", content_type="text/plain")

    return seen, handler


async def test_keep_alive_serves_several_requests_on_one_connection():
    async with serving(echo) as srv, connect(srv) as c:
        clients = set()
        for i in range(5):
            r = await c.request("POST", f"/n/{i}?x={i}", f"body{i}".encode())
            assert r.status == 200 and r.headers["connection"] == "keep-alive"
            got = r.json()
            assert (got["path"], got["query"], got["body"]) == (f"/n/{i}", f"x={i}", f"body{i}")
            clients.add(tuple(got["client"]))
        assert len(clients) == 1 and srv.connections == 1


async def test_request_fields_reach_the_handler():
    seen, handler = _recorder()

    async with serving(handler) as srv, connect(srv) as c:
        c.send(b"GET /a/b?q=1&r=2 HTTP/1.1\r\nHost: t\r\nX-Tag: one\r\nx-tag: two\r\nContent-Type: text/plain\r\n\r\n")
        r = await c.response()
    assert r.status == 200 and r.body == b"ok" and r.headers["content-type"] == "text/plain"
    req = seen[0]
    assert (req.method, req.path, req.query, req.http_version) == ("GET", "/a/b", "q=1&r=2", "1.1")
    assert req.headers["x-tag"] == "one, two" and req.header("content-type") == "text/plain"
    assert req.keep_alive and req.client[0] == "127.0.0.1" and req.received_at > 0


async def test_a_repeated_header_with_the_same_value_is_joined_too():
    # Short values that repeat are one shared str inside the scanner: joining must not
    # mistake the second for the first.
    seen, handler = _recorder()

    async with serving(handler) as srv, connect(srv) as c:
        c.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Tag: same\r\nx-tag: same\r\nX-TAG: other\r\n\r\n")
        assert (await c.response()).status == 200
    assert seen[0].headers["x-tag"] == "same, same, other"


@pytest.mark.parametrize(
    "header, ours",
    [
        (b"", False),
        (b"X-Tag: 1\r\nx-velocityx: 1\r\nx-request-idx: 1\r\n", False),
        (b"X-Velocity-Priority: high\r\n", True),
        (b"x-request-id: abc\r\n", True),
        (b"X-Session-ID: s1\r\n", True),
        (b"x-velocity-: 1\r\n", False),
    ],
)
async def test_the_request_says_whether_it_carries_a_header_the_gateway_reads(header, ours):
    # The proxy path looks up x-velocity-*, x-request-id and x-session-id only when the
    # request has one; a request llhttp parsed (split across reads) always says True.
    seen, handler = _recorder()

    data = b"GET /g HTTP/1.1\r\nHost: t\r\n" + header + b"\r\n"
    async with serving(handler) as srv, connect(srv) as c:
        c.send(data)
        assert (await c.response()).status == 200
        c.send(data[:7])
        await asyncio.sleep(0.05)
        c.send(data[7:])
        assert (await c.response()).status == 200
    assert [r.gateway_headers for r in seen] == [ours, True]
    assert seen[0].headers == seen[1].headers


async def test_pipelined_requests_are_answered_in_order_even_when_the_first_is_slowest():
    order = []

    async def handler(req, resp):
        order.append(("start", req.path))
        if req.path == "/slow":
            await asyncio.sleep(0.2)
        order.append(("end", req.path))
        resp.send(200, req.path.encode(), content_type="text/plain")

    async with serving(handler) as srv, connect(srv) as c:
        c.send(build("GET", "/slow") + build("GET", "/fast1") + build("POST", "/fast2", b"x"))
        bodies = [(await c.response()).body for _ in range(3)]
    assert bodies == [b"/slow", b"/fast1", b"/fast2"]
    # A later handler does not start before the earlier response is out.
    assert order == [
        ("start", "/slow"),
        ("end", "/slow"),
        ("start", "/fast1"),
        ("end", "/fast1"),
        ("start", "/fast2"),
        ("end", "/fast2"),
    ]


async def test_headers_read_late_are_each_requests_own_repeats_joined():
    # The scanner makes a request's header dict only when it is read: three requests
    # in one read, each read after the next ones were parsed, keep their own values.
    async def handler(req, resp):
        await asyncio.sleep(0.05)
        resp.send_json(200, {"headers": req.headers, "tag": req.header("x-tag"), "none": req.header("x-no")})

    async with serving(handler) as srv, connect(srv) as c:
        c.send(
            build("GET", "/a", headers={"X-Tag": "one", "Accept": "a/b"})
            + b"GET /b HTTP/1.1\r\nhost: h\r\nx-tag: two\r\nX-TAG:  three\r\n\r\n"
            + build("POST", "/c", b"{}", headers={"x-tag": "four"})
        )
        got = [orjson.loads((await c.response()).body) for _ in range(3)]
    assert [g["tag"] for g in got] == ["one", "two, three", "four"]
    assert got[0]["headers"]["accept"] == "a/b" and got[1]["headers"] == {"host": "h", "x-tag": "two, three"}
    assert got[2]["headers"]["content-length"] == "2" and all(g["none"] is None for g in got)


async def test_a_read_holding_a_whole_request_and_the_start_of_the_next_gives_both_whole():
    # The first request is scanned in the read buffer and its body copied out; the next
    # one's head and the first half of its body, in the same read, are kept for when the
    # rest arrives. Each handler reads its headers after the buffer was read again.
    async def handler(req, resp):
        await asyncio.sleep(0.05)
        resp.send_json(200, {"body": req.body.decode("latin-1"), "tag": req.header("x-tag")})

    first = bytes(range(32, 127)) * 200  # 19,000 bytes
    second = b"z" * 6000 + b"\xff" * 6000
    async with serving(handler) as srv, connect(srv) as c:
        two = build("POST", "/a", first, headers={"X-Tag": "one"}) + build(
            "POST", "/b", second, headers={"X-Tag": "two"}
        )
        cut = len(two) - 6000
        c.send(two[:cut])
        await asyncio.sleep(0.1)
        c.send(two[cut:])
        got = [orjson.loads((await c.response()).body) for _ in range(2)]
    assert got[0] == {"body": first.decode("latin-1"), "tag": "one"}
    assert got[1] == {"body": second.decode("latin-1"), "tag": "two"}


async def test_deep_pipelining_past_the_queue_limit_answers_every_request_in_order():
    async with serving(echo, max_pipelined=4) as srv, connect(srv) as c:
        c.send(b"".join(build("POST", f"/{i}", b"x" * i) for i in range(60)))
        paths = [(await c.response()).json()["path"] for _ in range(60)]
        assert paths == [f"/{i}" for i in range(60)]
        # Reading resumed: the connection still takes a new request.
        assert (await c.request("GET", "/last")).json()["path"] == "/last"


@pytest.mark.parametrize("max_pipelined", [1, 2, 3])
async def test_small_pipeline_limits_still_answer_everything(max_pipelined):
    async def handler(req, resp):
        await asyncio.sleep(0.005)  # requests pile up while each is answered
        await echo(req, resp)

    async with serving(handler, max_pipelined=max_pipelined) as srv, connect(srv) as c:
        for i in range(12):  # each in its own read, so that reading really pauses between them
            c.send(build("GET", f"/{i}"))
            await c.writer.drain()
            await asyncio.sleep(0.002)
        paths = [(await c.response()).json()["path"] for _ in range(12)]
        assert paths == [f"/{i}" for i in range(12)]


async def test_content_length_and_chunked_bodies_arrive_whole():
    async with serving(echo) as srv, connect(srv) as c:
        big = bytes(range(256)) * 1024
        c.send(build("POST", "/cl", big))
        r = await c.response()
        assert r.json()["body"].encode("latin-1") == big
        c.send(
            b"POST /chunked HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(b"hello ", b"chunked ", b"world")
        )
        assert (await c.response()).json()["body"] == "hello chunked world"


async def test_a_body_sent_in_small_pieces_arrives_whole():
    async with serving(echo) as srv, connect(srv) as c:
        raw = (
            b"POST /p HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(b"a" * 100, b"b" * 50)
            + build("POST", "/q", b"tail")
        )
        for i in range(0, len(raw), 7):
            c.send(raw[i : i + 7])
            await c.writer.drain()
        assert (await c.response()).json()["body"] == "a" * 100 + "b" * 50
        assert (await c.response()).json()["body"] == "tail"


async def test_expect_100_continue_sends_the_interim_response_before_the_body_is_needed():
    async with serving(echo) as srv, connect(srv) as c:
        c.send(build("POST", "/e", None, {"Expect": "100-continue", "Content-Length": "5"}))
        status, _ = await c.head()
        assert status == 100
        c.send(b"hello")
        r = await c.response()
        assert r.status == 200 and r.json()["body"] == "hello" and r.interim == []


async def test_100_continue_waits_for_the_response_ahead_of_it():
    release = asyncio.Event()

    async def handler(req, resp):
        if req.path == "/slow":
            await release.wait()
        await echo(req, resp)

    async with serving(handler) as srv, connect(srv) as c:
        c.send(build("GET", "/slow") + build("POST", "/e", None, {"Expect": "100-continue", "Content-Length": "2"}))
        # The 100 must not interleave with (or come before) the slow response.
        assert await c.closed(timeout=0.2) is False
        release.set()
        first = await c.response()
        assert first.json()["path"] == "/slow" and first.interim == []
        status, _ = await c.head()
        assert status == 100
        c.send(b"ok")
        assert (await c.response()).json()["body"] == "ok"


async def test_a_body_sent_without_waiting_for_100_gets_no_stray_interim_response():
    release = asyncio.Event()

    async def handler(req, resp):
        if req.path == "/slow":
            await release.wait()
        await echo(req, resp)

    async with serving(handler) as srv, connect(srv) as c:
        c.send(build("GET", "/slow"))
        await asyncio.sleep(0.05)
        c.send(build("POST", "/e", None, {"Expect": "100-continue", "Content-Length": "2"}))
        await asyncio.sleep(0.05)
        c.send(b"ok")  # the client gave up waiting for 100, as clients do after a while
        await asyncio.sleep(0.05)
        release.set()
        assert (await c.response()).json()["path"] == "/slow"
        second = await c.response()
        assert second.json()["body"] == "ok"
        # Nothing may follow the final answer of that request: the next response is plain.
        third = await c.request("GET", "/next")
        assert third.interim == [] and third.json()["path"] == "/next"


async def test_http_1_0_gets_its_answer_and_the_connection_closes():
    async with serving(echo) as srv, connect(srv) as c:
        c.send(b"GET /old HTTP/1.0\r\n\r\n")
        r = await c.response()
        assert r.status == 200 and r.headers["connection"] == "close"
        assert r.json()["version"] == "1.0" and r.json()["keep_alive"] is False
        assert await c.closed()


async def test_http_1_0_with_keep_alive_keeps_the_connection():
    async with serving(echo) as srv, connect(srv) as c:
        for i in range(2):
            r = await c.request("GET", f"/k{i}", headers={"Connection": "keep-alive"}, version="1.0")
            assert r.headers["connection"] == "keep-alive" and r.json()["path"] == f"/k{i}"


async def test_http_1_0_stream_is_close_delimited():
    async def handler(req, resp):
        resp.start(200, content_type="text/plain")
        for i in range(3):
            await resp.write(b"part%d;" % i)
        resp.end()

    async with serving(handler) as srv, connect(srv) as c:
        c.send(b"GET /s HTTP/1.0\r\n\r\n")
        r = await c.response()
        assert "transfer-encoding" not in r.headers and "content-length" not in r.headers
        assert r.body == b"part0;part1;part2;"


async def test_connection_close_request_closes_after_the_answer():
    async with serving(echo) as srv, connect(srv) as c:
        r = await c.request("GET", "/bye", headers={"Connection": "close"})
        assert r.status == 200 and r.headers["connection"] == "close"
        assert await c.closed()


async def test_head_gets_the_headers_of_get_without_a_body():
    async def handler(req, resp):
        if req.path == "/stream":
            resp.start(200)
            await resp.write(b"data: 1\n\n")
            resp.end()
        else:
            resp.send(200, b"0123456789", content_type="text/plain")

    async with serving(handler) as srv, connect(srv) as c:
        r = await c.request("HEAD", "/whole")
        assert r.status == 200 and r.headers["content-length"] == "10" and r.body == b""
        r = await c.request("HEAD", "/stream")
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
        # No stray body bytes: the next answer on the connection parses cleanly.
        r = await c.request("GET", "/whole")
        assert r.body == b"0123456789"


async def test_an_upgrade_request_is_answered_as_plain_http():
    # What `curl --http2` sends to an http:// URL: the server may ignore the upgrade.
    async with serving(echo) as srv, connect(srv) as c:
        c.send(
            build(
                "GET",
                "/up",
                None,
                {
                    "Connection": "Upgrade, HTTP2-Settings",
                    "Upgrade": "h2c",
                    "HTTP2-Settings": "AAMAAABkAAQAoAAAAAIAAAAA",
                },
            )
            + build("GET", "/after-up")
        )
        r = await c.response()
        assert r.status == 200 and r.json()["path"] == "/up"
        assert (await c.response()).json()["path"] == "/after-up"
        assert (await c.request("GET", "/again")).json()["path"] == "/again"


async def test_requests_pipelined_after_connection_close_do_not_destroy_its_answer():
    # The server stops reading a full pipeline; closing with that input unread would
    # make the kernel reset the connection and drop the unsent part of the answer.
    big = b"z" * 4_000_000

    async def handler(req, resp):
        resp.send(200, big if req.path == "/big" else b"{}", content_type="application/octet-stream")

    async with serving(handler, max_pipelined=2) as srv:
        for _ in range(3):
            async with connect(srv, rcvbuf=65536) as c:
                c.send(
                    build("GET", "/big", headers={"Connection": "close"})
                    + b"".join(build("POST", f"/{i}", b"x" * 1000) for i in range(2000))
                )
                await asyncio.sleep(0.1)  # the client is slow to read
                r = await c.response()
                assert r.status == 200 and r.body == big
                assert await c.closed()  # the requests after the close are not answered


@pytest.mark.parametrize("size", [0, 1, 9, 10, 99, 100, 16383, 16384, 1_000_001])
async def test_content_length_is_exact_at_every_digit_count_and_size(size):
    # The length is written by the compiled head builder, and bodies from 16 KiB up
    # leave in a write of their own: each must still frame the body exactly.
    body = bytes(i % 251 for i in range(size))

    async def handler(req, resp):
        resp.send(200, body, content_type="application/octet-stream")

    async with serving(handler) as srv, connect(srv) as c:
        for _ in range(2):  # the next response on the connection parses: nothing was left over
            r = await c.request("GET", "/b")
            assert r.status == 200 and r.headers["content-length"] == str(size) and r.body == body
