"""Graceful shutdown of the HTTP server, in-process and by SIGTERM to a process
running run_until_signalled (velocity_fast/server/connection.pyx, run.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support.server_wire import WAIT, Conn, build, connect, echo
from velocity_fast.server.errors import ClientDisconnected
from velocity_fast.server.http_server import HTTPServer
from velocity_fast.server.limits import ServerLimits

APP = Path(__file__).resolve().parents[1] / "support" / "server_sigterm_app.py"


def streaming(chunks: int, interval: float, log: list | None = None):
    """A handler streaming `chunks` events `interval` s apart on /stream; echo elsewhere."""

    async def handler(req, resp):
        if req.path != "/stream":
            await echo(req, resp)
            return
        resp.start(200)
        try:
            for i in range(chunks):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(interval)
            resp.end()
        except (ClientDisconnected, asyncio.CancelledError) as e:
            if log is not None:
                log.append(type(e).__name__)
            raise

    return handler


async def started(handler, **limits) -> HTTPServer:
    srv = HTTPServer(handler, limits=ServerLimits(**limits), name="test")
    await srv.start("127.0.0.1", 0)
    return srv


async def test_shutdown_finishes_a_stream_in_flight_closes_idle_connections_and_refuses_new_ones():
    srv = await started(streaming(chunks=8, interval=0.03))
    stopping = None
    try:
        async with connect(srv) as streamer, connect(srv) as idle:
            assert (await idle.request("GET", "/warm")).status == 200
            streamer.send(build("GET", "/stream"))
            await streamer.head()
            assert await streamer.chunk() == b"data: 0\n\n"

            t0 = time.monotonic()
            stopping = asyncio.create_task(srv.shutdown(grace=5.0))
            # The idle keep-alive connection is closed at once ...
            assert await idle.closed(timeout=1.0)
            # ... no new connection is accepted ...
            with pytest.raises(OSError):
                await asyncio.wait_for(asyncio.open_connection("127.0.0.1", srv.port), 1.0)
            # ... and the stream in flight runs to its end, then its connection closes.
            rest = [c async for c in streamer.chunks()]
            assert rest == [b"data: %d\n\n" % i for i in range(1, 8)]
            assert await streamer.closed()
            await asyncio.wait_for(stopping, WAIT)
            assert time.monotonic() - t0 < 5.0 / 2  # it did not wait out the grace
            assert srv.connections == 0 and srv.in_flight == 0
    finally:
        if stopping is None:
            await srv.shutdown(grace=0)


async def test_a_request_arriving_during_shutdown_on_an_open_connection_is_answered_with_close():
    srv = await started(streaming(chunks=5, interval=0.03))
    try:
        async with connect(srv) as c:
            c.send(build("GET", "/stream"))
            await c.head()
            stopping = asyncio.create_task(srv.shutdown(grace=5.0))
            await asyncio.sleep(0.01)
            c.send(build("GET", "/late"))  # pipelined behind the stream
            assert len([x async for x in c.chunks()]) == 5
            await asyncio.wait_for(stopping, WAIT)
            assert await c.closed()
    finally:
        await srv.shutdown(grace=0)


async def test_an_event_stream_left_after_the_grace_ends_with_an_error_event_and_done():
    """As an engine that dies mid-stream is relayed: vLLM's error event, `data: [DONE]`,
    then the stream's proper end; the handler sees a disconnect."""
    log: list[str] = []
    srv = await started(streaming(chunks=1000, interval=0.02, log=log))  # 20 s if left alone
    try:
        async with connect(srv) as c:
            c.send(build("GET", "/stream"))
            await c.head()
            await c.chunk()
            t0 = time.monotonic()
            await asyncio.wait_for(srv.shutdown(grace=0.2), WAIT)
            took = time.monotonic() - t0
            assert 0.2 * 0.5 <= took < 0.2 * 10
            rest = b"".join([x async for x in c.chunks()])  # a whole chunked body: its last chunk came
            events = [e for e in rest.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            assert json.loads(events[-2].removeprefix(b"data: ")) == {
                "error": {
                    "message": "The server shut down before the response was complete.",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            }
            assert all(e.startswith(b"data: ") and e[6:].isdigit() for e in events[:-2])
            assert await c.closed()
        assert log and srv.in_flight == 0 and srv.connections == 0 and srv.cut == 1
    finally:
        await srv.shutdown(grace=0)


async def test_a_stream_that_is_no_event_stream_left_after_the_grace_is_aborted():
    async def ndjson(req, resp):
        resp.start(200, content_type="application/x-ndjson")
        for i in range(1000):
            await resp.write(b'{"n": %d}\n' % i)
            await asyncio.sleep(0.02)

    srv = await started(ndjson)
    try:
        async with connect(srv) as c:
            c.send(build("GET", "/"))
            await c.head()
            await c.chunk()
            await asyncio.wait_for(srv.shutdown(grace=0.2), WAIT)
            # The client sees the stream cut off: no last chunk.
            with pytest.raises((asyncio.IncompleteReadError, ConnectionResetError)):
                while await c.chunk() is not None:
                    pass
        assert srv.in_flight == 0 and srv.connections == 0 and srv.cut == 0
    finally:
        await srv.shutdown(grace=0)


async def test_a_request_not_answered_within_the_grace_gets_a_503_and_its_handler_is_cancelled():
    state = {}

    async def stuck(req, resp):
        try:
            await asyncio.sleep(60)  # an upstream that never answers
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    srv = await started(stuck)
    try:
        async with connect(srv) as c:
            c.send(build("GET", "/"))
            for _ in range(100):
                if srv.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert srv.requests == 1
            t0 = time.monotonic()
            await asyncio.wait_for(srv.shutdown(grace=0.1), WAIT)
            assert time.monotonic() - t0 < 0.1 + 1.0  # not held for the endings' flush time
            r = await c.response()
            assert r.status == 503 and r.headers["connection"] == "close"
            assert r.json()["error"]["message"] == "The server shut down before the response was complete."
            assert await c.closed()
        assert state == {"cancelled": True} and srv.in_flight == 0
    finally:
        await srv.shutdown(grace=0)


async def test_shutdown_twice_at_once_waits_for_the_same_end():
    srv = await started(streaming(chunks=5, interval=0.03))
    async with connect(srv) as c:
        c.send(build("GET", "/stream"))
        await c.head()
        both = asyncio.gather(srv.shutdown(grace=5.0), srv.shutdown(grace=5.0))
        assert len([x async for x in c.chunks()]) == 5
        await asyncio.wait_for(both, WAIT)
    await srv.shutdown(grace=0)  # and once more after the end: nothing to do


async def _spawn(*args: str) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(APP), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        if not line.startswith(b"listening "):
            raise AssertionError(f"app did not start: {line!r} {await proc.stderr.read()!r}")
    except BaseException:
        await _stop(proc)
        raise
    return proc, int(line.split()[1])


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:  # it exited on its own meanwhile
            pass
        await proc.wait()


@pytest.mark.parametrize(
    "shape,sig",
    [("cleanup", signal.SIGTERM), ("servers", signal.SIGTERM), ("context", signal.SIGTERM), ("servers", signal.SIGINT)],
)
async def test_a_signal_finishes_in_flight_work_and_the_process_exits_0(shape, sig):
    proc, port = await _spawn(shape, "10", "0.03", "5")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        c = Conn(reader, writer)
        try:
            c.send(build("GET", "/stream"))
            await c.head()
            assert await c.chunk() == b"data: 0\n\n"
            proc.send_signal(sig)
            rest = [x async for x in c.chunks()]
            assert rest == [b"data: %d\n\n" % i for i in range(1, 10)] + [b"data: [DONE]\n\n"]
            assert await c.closed()
        finally:
            await c.close()
        code = await asyncio.wait_for(proc.wait(), 20)
        out = await proc.stdout.read()
        err = await proc.stderr.read()
        assert code == 0, err
        assert out.strip() == b"stopped", (out, err)
    finally:
        await _stop(proc)


async def test_a_signal_with_nothing_in_flight_exits_at_once():
    proc, port = await _spawn("cleanup", "1", "0.01", "30")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        c = Conn(reader, writer)
        try:
            assert (await c.request("GET", "/")).status == 200  # an idle keep-alive connection
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            assert time.monotonic() - t0 < 30 / 3  # did not wait out the grace
        finally:
            await c.close()
    finally:
        await _stop(proc)
