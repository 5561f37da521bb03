"""Streamed responses, write flow control, disconnects and handler errors on real
sockets (velocity_fast/server/connection.pyx)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.server_wire import WAIT, assert_error_shape, build, connect, serving, still_serving
from velocity_fast.server.errors import ClientDisconnected


async def test_sse_stream_is_chunked_with_event_stream_headers():
    async def handler(req, resp):
        resp.start(200, headers=[("x-request-id", "r1")])
        for i in range(3):
            await resp.write(b'data: {"i": %d}\n\n' % i)
        await resp.write(b"data: [DONE]\n\n")
        resp.end()

    async with serving(handler) as srv, connect(srv) as c:
        r = await c.request("POST", "/v1/chat/completions", b"{}")
        assert r.status == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["transfer-encoding"] == "chunked" and r.headers["x-request-id"] == "r1"
        assert r.chunks == [b'data: {"i": 0}\n\n', b'data: {"i": 1}\n\n', b'data: {"i": 2}\n\n', b"data: [DONE]\n\n"]
        # The stream ended cleanly: the connection serves the next request.
        assert (await c.request("GET", "/again")).status == 200


async def test_a_stream_asked_with_connection_close_ends_and_closes():
    async def handler(req, resp):
        resp.start(200)
        await resp.write(b"data: only\n\n")
        resp.end()

    async with serving(handler) as srv, connect(srv) as c:
        r = await c.request("GET", "/s", headers={"Connection": "close"})
        assert r.headers["connection"] == "close" and r.chunks == [b"data: only\n\n"]
        assert await c.closed()


async def test_chunks_reach_the_client_as_they_are_written():
    step = asyncio.Event()

    async def handler(req, resp):
        resp.start(200, content_type="application/x-ndjson")
        await resp.write(b"first\n")
        await step.wait()
        await resp.write(b"second\n")

    async with serving(handler) as srv, connect(srv) as c:
        c.send(build("GET", "/s"))
        status, headers = await c.head()
        assert status == 200 and headers["content-type"] == "application/x-ndjson"
        assert await c.chunk() == b"first\n"  # before the handler went on
        step.set()
        assert await c.chunk() == b"second\n"
        assert await c.chunk() is None  # a handler that returns mid-stream has the stream ended


async def test_a_slow_reader_pauses_the_producer_and_buffered_bytes_stay_bounded():
    chunk = b"x" * 16384
    total = 2048  # 32 MiB if nothing held the producer back
    # What may be in flight: the server's buffer (64 KiB) plus small kernel buffers
    # on both ends and the client's stream buffer; far below the 32 MiB.
    bound = 1 << 20
    state = {"written": 0}
    done = asyncio.Event()

    async def handler(req, resp):
        state["resp"] = resp
        resp.start(200, content_type="application/octet-stream")
        for _ in range(total):
            await resp.write(chunk)
            state["written"] += len(chunk)
        resp.end()
        done.set()

    async with serving(handler, write_buffer_high=64 * 1024, sndbuf=16384) as srv, connect(srv, rcvbuf=16384) as c:
        c.send(build("GET", "/big"))
        await c.head()
        # The client reads nothing: the producer must stop, not fill memory.
        last, steady = -1, 0
        for _ in range(200):
            await asyncio.sleep(0.01)
            steady = steady + 1 if state["written"] == last else 0
            last = state["written"]
            if steady == 10:
                break
        stalled_at = state["written"]
        assert not done.is_set() and state["resp"].paused
        assert 0 < stalled_at <= bound, stalled_at
        await asyncio.sleep(0.1)
        assert state["written"] == stalled_at  # still held back
        # Reading again resumes the producer; the client gets every byte, in order,
        # and what is in flight stays bounded all along.
        received = 0
        while True:
            part = await c.chunk()
            if part is None:
                break
            assert part == chunk[: len(part)]
            received += len(part)
            assert state["written"] - received <= bound
        assert received == total * len(chunk)
        await asyncio.wait_for(done.wait(), WAIT)


async def test_write_nowait_producers_see_paused_and_keep_their_own_backlog():
    chunk = b"y" * 16384
    stats = {"queued": 0, "waits": 0}

    async def handler(req, resp):
        # The shape of a producer serving many streams: queue without awaiting, and
        # drain only when the server says the client is behind.
        resp.start(200, content_type="application/octet-stream")
        for _ in range(400):
            assert resp.write_nowait(chunk) is True
            stats["queued"] += 1
            if resp.paused:
                stats["waits"] += 1
                await resp.write(b"")  # waits until the client drained
        resp.end()

    async with serving(handler, write_buffer_high=32 * 1024) as srv, connect(srv, rcvbuf=16384) as c:
        c.send(build("GET", "/p"))
        await c.head()
        await asyncio.sleep(0.2)
        assert stats["waits"] >= 1 and stats["queued"] < 400  # the slow reader held it back
        body = b"".join([part async for part in c.chunks()])
        assert body == chunk * 400


async def test_exception_before_responding_is_a_500_in_the_error_shape():
    async def handler(req, resp):
        if req.path == "/boom":
            raise ValueError("bug")
        resp.send(200, b"{}")

    async with serving(handler) as srv, connect(srv) as c:
        r = await c.request("GET", "/boom")
        assert_error_shape(r, 500)
        # Not a connection error: the same connection goes on.
        assert (await c.request("GET", "/fine")).status == 200


async def test_a_handler_that_returns_without_answering_is_a_500():
    async def handler(req, resp):
        return None

    async with serving(handler) as srv, connect(srv) as c:
        assert_error_shape(await c.request("GET", "/nothing"), 500)


async def test_exception_mid_stream_closes_the_connection():
    async def handler(req, resp):
        if req.path == "/ok":
            resp.send(200, b"{}")
            return
        resp.start(200)
        await resp.write(b"data: 1\n\n")
        raise RuntimeError("engine went away")

    async with serving(handler) as srv:
        async with connect(srv) as c:
            c.send(build("GET", "/s"))
            await c.head()
            assert await c.chunk() == b"data: 1\n\n"
            # No last chunk: the client can tell the stream broke.
            with pytest.raises(asyncio.IncompleteReadError):
                await c.chunk()
        async with connect(srv) as c2:
            assert (await c2.request("GET", "/ok")).status == 200


async def test_disconnect_mid_stream_fires_callbacks_once_and_write_raises():
    seen = {"callbacks": 0, "raised": False}
    ended = asyncio.Event()

    async def handler(req, resp):
        if req.path == "/after":  # still_serving's probe
            resp.send(200, b"{}")
            return
        resp.start(200)
        resp.add_disconnect_callback(lambda: seen.__setitem__("callbacks", seen["callbacks"] + 1))
        try:
            for i in range(500):  # bounded: 10 s at most
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.02)
        except ClientDisconnected:
            seen["raised"] = True
        finally:
            ended.set()

    async with serving(handler) as srv:
        async with connect(srv) as c:
            c.send(build("GET", "/s"))
            await c.head()
            await c.chunk()
            c.abort()
        await asyncio.wait_for(ended.wait(), WAIT)
        assert seen == {"callbacks": 1, "raised": True}
        await still_serving(srv)


async def test_disconnect_while_a_non_streaming_handler_awaits_fires_the_callback():
    gone = asyncio.Event()
    finished = asyncio.Event()
    state = {}

    async def handler(req, resp):
        if req.path == "/after":  # still_serving's probe
            resp.send(200, b"{}")
            return
        resp.add_disconnect_callback(gone.set)
        try:
            await asyncio.wait_for(gone.wait(), WAIT)  # e.g. waiting on an engine
        finally:
            state["disconnected"] = resp.disconnected
            finished.set()
        resp.send(200, b"{}")  # too late: nobody to send to, and no error

    async with serving(handler) as srv:
        async with connect(srv) as c:
            c.send(build("POST", "/generate", b"{}"))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(finished.wait(), WAIT)
        assert state == {"disconnected": True}
        await still_serving(srv)


async def leave_during(handler, done: asyncio.Event) -> None:
    """Serve ``handler``; a client sends GET / and leaves while it runs; wait for ``done``."""
    async with serving(handler) as srv:
        async with connect(srv) as c:
            c.send(build("GET", "/"))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(done.wait(), WAIT)


async def test_a_callback_added_after_the_client_left_runs_at_once():
    ran = asyncio.Event()
    gone = asyncio.Event()

    async def handler(req, resp):
        resp.add_disconnect_callback(gone.set)
        await asyncio.wait_for(gone.wait(), WAIT)
        resp.add_disconnect_callback(ran.set)

    await leave_during(handler, ran)


async def test_a_failing_disconnect_callback_does_not_stop_the_others(caplog):
    ran = []
    gone = asyncio.Event()

    def broken():
        raise ValueError("callback bug")

    async def handler(req, resp):
        resp.add_disconnect_callback(broken)
        resp.add_disconnect_callback(lambda: ran.append("second"))
        resp.add_disconnect_callback(gone.set)
        await asyncio.wait_for(gone.wait(), WAIT)

    await leave_during(handler, gone)
    assert ran == ["second"]
    assert "disconnect callback failed" in caplog.text


async def test_a_removed_disconnect_callback_does_not_run():
    ran = []
    gone = asyncio.Event()

    async def handler(req, resp):
        cb = lambda: ran.append("removed")  # noqa: E731
        resp.add_disconnect_callback(cb)
        resp.remove_disconnect_callback(cb)
        resp.add_disconnect_callback(gone.set)
        await asyncio.wait_for(gone.wait(), WAIT)

    await leave_during(handler, gone)
    assert ran == []


async def test_no_disconnect_callback_after_a_finished_response():
    fired = []

    async def handler(req, resp):
        resp.add_disconnect_callback(lambda: fired.append(req.path))
        if req.path == "/stream":
            resp.start(200)
            await resp.write(b"data: x\n\n")
            resp.end()
        else:
            resp.send(200, b"{}")

    async with serving(handler) as srv:
        async with connect(srv) as c:
            assert (await c.request("GET", "/whole")).status == 200
            assert (await c.request("GET", "/stream")).status == 200
        for _ in range(100):
            if srv.connections == 0:
                break
            await asyncio.sleep(0.01)
        assert srv.connections == 0 and fired == []


async def test_writing_after_the_end_is_refused_instead_of_corrupting_the_next_response():
    errors = []

    async def handler(req, resp):
        resp.start(200)
        await resp.write(b"data: 1\n\n")
        resp.end()
        try:
            resp.write_nowait(b"late")
        except RuntimeError as e:
            errors.append(str(e))

    async with serving(handler) as srv, connect(srv) as c:
        assert (await c.request("GET", "/a")).chunks == [b"data: 1\n\n"]
        assert (await c.request("GET", "/b")).chunks == [b"data: 1\n\n"]
    assert errors == ["response finished", "response finished"]
