"""The gateway's own socket I/O (velocity_fast/io/fdio.pyx) on real 127.0.0.1 sockets:
asyncio's Transport semantics that the server and the engine pool rely on."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from contextlib import asynccontextmanager

import pytest

from tests.support.server_wire import connect
from velocity_fast.io import fdio
from velocity_fast.server.http_server import HTTPServer

WAIT = 10.0


class Recorder(asyncio.Protocol):
    """Keeps what a connection sees: bytes, EOF, flow-control calls, how it ended."""

    def __init__(self, *, echo=False, eof_keep_open=None):
        self.echo = echo
        self.eof_keep_open = eof_keep_open
        self.transport = None
        self.data = bytearray()
        self.events: list[str] = []
        self.lost = asyncio.get_running_loop().create_future()
        self.got = asyncio.Event()

    def connection_made(self, transport):
        self.transport = transport
        self.events.append("made")

    def data_received(self, data):
        self.data += data
        self.got.set()
        if self.echo:
            self.transport.write(data)

    def eof_received(self):
        self.events.append("eof")
        return self.eof_keep_open

    def pause_writing(self):
        self.events.append("pause")

    def resume_writing(self):
        self.events.append("resume")

    def connection_lost(self, exc):
        self.events.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)

    async def until(self, n):
        while len(self.data) < n:
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), WAIT)


@asynccontextmanager
async def pair(**server_kw):
    """A connected (server, client transport, client protocol, server protocol) on
    127.0.0.1; the client transport aborted and the server closed when the block ends."""
    loop = asyncio.get_running_loop()
    accepted = loop.create_future()

    def factory():
        proto = Recorder(**server_kw)
        if not accepted.done():
            accepted.set_result(proto)
        return proto

    server = fdio.Server(loop, factory, fdio.listen("127.0.0.1", 0), 16)
    try:
        port = server.sockets[0].getsockname()[1]
        t, client = await fdio.open_connection(loop, Recorder, "127.0.0.1", port)
        try:
            srv = await asyncio.wait_for(accepted, WAIT)
            await asyncio.sleep(0)
            yield server, t, client, srv
        finally:
            t.abort()  # (nothing more once it is lost)
    finally:
        server.close()


async def test_bytes_cross_both_ways_and_the_peer_is_known():
    async with pair(echo=True) as (server, t, client, srv):
        assert isinstance(t, fdio.FdTransport) and isinstance(srv.transport, fdio.FdTransport)
        assert srv.transport.get_extra_info("peername") == t.get_extra_info("sockname")
        assert t.get_extra_info("peername") == server.sockets[0].getsockname()
        assert isinstance(t.get_extra_info("socket"), socket.socket)
        assert t.get_extra_info("nothing", "default") == "default"
        t.write(b"hello ")
        t.writelines([b"wor", bytearray(b"ld"), memoryview(b"!")])
        await client.until(12)
        assert bytes(client.data) == b"hello world!" and bytes(srv.data) == b"hello world!"
        with pytest.raises(TypeError):
            t.write("text")


async def test_a_slow_reader_pauses_the_writer_and_every_byte_arrives_in_order():
    async with pair() as (server, t, client, srv):
        srv.transport.pause_reading()
        assert not srv.transport.is_reading()
        t.set_write_buffer_limits(high=64 * 1024)
        assert t.get_write_buffer_limits() == (16 * 1024, 64 * 1024)
        blob = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the kernel buffers hold
        for i in range(0, len(blob), 1 << 20):
            t.write(blob[i : i + (1 << 20)])
        await asyncio.sleep(0.05)
        assert client.events[-1] == "pause"  # the writer was told to stop
        assert t.get_write_buffer_size() > 64 * 1024
        assert len(srv.data) == 0  # nothing read while paused
        srv.transport.resume_reading()
        await srv.until(len(blob))
        assert hashlib.sha256(srv.data).digest() == hashlib.sha256(blob).digest()
        for _ in range(100):
            if client.events[-1] == "resume":
                break
            await asyncio.sleep(0.01)
        assert client.events[-1] == "resume" and t.get_write_buffer_size() == 0


async def test_close_delivers_what_waits_then_reports_the_loss():
    async with pair() as (server, t, client, srv):
        srv.transport.pause_reading()
        blob = b"x" * (4 << 20)
        t.write(blob)
        assert t.get_write_buffer_size() > 0
        t.close()
        assert t.is_closing()
        t.close()  # twice is harmless
        assert not client.lost.done()
        srv.transport.resume_reading()
        await srv.until(len(blob))
        assert await asyncio.wait_for(client.lost, WAIT) is None
        assert await asyncio.wait_for(srv.lost, WAIT) is None
        assert srv.events[-2:] == ["eof", "lost"] and len(srv.data) == len(blob)


async def test_abort_drops_what_waits_and_reports_the_loss_from_the_loop():
    async with pair() as (server, t, client, srv):
        srv.transport.pause_reading()
        t.write(b"y" * (4 << 20))
        t.abort()
        assert "lost" not in client.events  # from the loop's ready queue, not from abort()
        assert await asyncio.wait_for(client.lost, WAIT) is None
        t.write(b"more")  # after the loss: ignored, as asyncio does
        srv.transport.resume_reading()
        await asyncio.wait_for(srv.lost, WAIT)
        assert len(srv.data) < 4 << 20


async def test_write_eof_half_closes_and_the_answer_still_arrives():
    async with pair(eof_keep_open=True) as (server, t, client, srv):
        t.write(b"question")
        t.write_eof()
        assert t.can_write_eof()
        with pytest.raises(RuntimeError):
            t.write(b"late")
        await srv.until(8)
        for _ in range(100):
            if "eof" in srv.events:
                break
            await asyncio.sleep(0.01)
        assert srv.events[-1] == "eof" and not srv.transport.is_closing()  # kept open
        srv.transport.write(b"answer")
        srv.transport.close()
        await client.until(6)
        assert bytes(client.data) == b"answer"
        assert await asyncio.wait_for(client.lost, WAIT) is None


async def test_a_reset_by_the_peer_reaches_connection_lost():
    async with pair() as (server, t, client, srv):
        sock = srv.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        t.write(b"unread")  # unread input makes the close a reset
        await srv.until(1)
        srv.transport.pause_reading()
        await asyncio.sleep(0.01)
        srv.transport.abort()
        exc = await asyncio.wait_for(client.lost, WAIT)
        # Read first (EOF after the reset, or the reset itself): either way the loss is reported once.
        assert exc is None or isinstance(exc, ConnectionResetError)
        assert client.events.count("lost") == 1


async def test_an_error_in_data_received_goes_to_the_loop_handler_and_closes():
    loop = asyncio.get_running_loop()
    seen = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda lp, ctx: seen.append(ctx))

    class Broken(Recorder):
        def data_received(self, data):
            raise ValueError("bad bytes")

    accepted = loop.create_future()
    server = fdio.Server(
        loop, lambda: accepted.set_result(Broken()) or accepted.result(), fdio.listen("127.0.0.1", 0), 16
    )
    try:
        t, client = await fdio.open_connection(loop, Recorder, "127.0.0.1", server.sockets[0].getsockname()[1])
        t.write(b"boom")
        srv = await asyncio.wait_for(accepted, WAIT)
        exc = await asyncio.wait_for(srv.lost, WAIT)
        assert isinstance(exc, ValueError)
        assert seen and "data_received" in seen[0]["message"] and seen[0]["protocol"] is srv
        assert await asyncio.wait_for(client.lost, WAIT) is None  # the peer saw the close
    finally:
        loop.set_exception_handler(old)
        server.close()


async def test_connect_refused_is_an_oserror_and_a_closed_server_accepts_no_more():
    loop = asyncio.get_running_loop()
    server = fdio.Server(loop, Recorder, fdio.listen("127.0.0.1", 0), 16)
    port = server.sockets[0].getsockname()[1]
    assert server.is_serving()
    server.close()
    await server.wait_closed()
    assert server.sockets == () and not server.is_serving()
    with pytest.raises(ConnectionRefusedError):
        await fdio.open_connection(loop, Recorder, "127.0.0.1", port)
    assert fdio.poller_for(loop).transports == 0  # nothing left registered


async def test_the_loops_own_transports_serve_when_asked(monkeypatch):
    async def handler(req, resp):
        resp.send(200, type(resp.proto._transport).__name__.encode())

    for io, fd in (("asyncio", False), ("epoll", True)):
        monkeypatch.setenv("VELOCITY_IO", io)
        assert fdio.enabled() is fd
        srv = HTTPServer(handler)
        await srv.start()
        try:
            async with connect(srv) as c:
                r = await c.request("GET", "/which")
                assert r.status == 200 and (r.body == b"FdTransport") is fd
        finally:
            await srv.shutdown(1.0)
