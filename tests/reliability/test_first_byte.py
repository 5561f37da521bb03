"""The first byte of a request is bounded like the rest of its head: a new
connection that sends nothing is closed, quietly as nginx's client_header_timeout does,
after ServerLimits.first_byte_timeout (server.first_byte_timeout_s in the settings,
header_timeout_s when unset); between requests a kept-alive connection still waits
keepalive_timeout. On real sockets, with short values."""

from __future__ import annotations

import asyncio
import time

from tests.support.gateway import running_gateway
from tests.support.server_wire import connect, echo, serving, still_serving
from tests.support.sim import http_request, sim_engine

LIMITS = dict(header_timeout=5.0, body_timeout=5.0, keepalive_timeout=5.0)


async def test_a_silent_new_connection_is_closed_quietly_after_the_first_byte_timeout():
    async with serving(echo, **dict(LIMITS, first_byte_timeout=0.3)) as srv, connect(srv) as c:
        t0 = time.monotonic()
        assert await c.closed(timeout=3.0)  # (it asserts that no byte came first: a quiet close)
        waited = time.monotonic() - t0
        assert 0.3 * 0.5 <= waited <= 0.3 * 8, waited  # at its timeout, not the 5 s keep-alive
        await still_serving(srv)


async def test_unset_it_is_the_header_timeout_not_the_keep_alive_timeout():
    async with serving(echo, **dict(LIMITS, header_timeout=0.3)) as srv, connect(srv) as c:
        t0 = time.monotonic()
        assert await c.closed(timeout=3.0)  # (it asserts that no byte came first: a quiet close)
        assert time.monotonic() - t0 <= 0.3 * 8


async def test_a_kept_alive_connection_waits_the_keep_alive_time_between_requests():
    limits = dict(LIMITS, first_byte_timeout=0.2, keepalive_timeout=1.5)
    async with serving(echo, **limits) as srv, connect(srv) as c:
        assert (await c.request("GET", "/one")).status == 200
        await asyncio.sleep(0.6)  # three first-byte timeouts, well under the keep-alive time
        assert (await c.request("GET", "/two")).status == 200
        t0 = time.monotonic()
        assert await c.closed(timeout=5.0)
        waited = time.monotonic() - t0
        assert 1.5 * 0.5 <= waited <= 1.5 * 3, waited


async def test_a_first_byte_in_time_starts_the_head_timeout():
    """A head begun within the first-byte time then has header_timeout to finish: a 408."""
    limits = dict(LIMITS, first_byte_timeout=0.2, header_timeout=0.8)
    async with serving(echo, **limits) as srv, connect(srv) as c:
        c.send(b"GET /slow HTTP/1.1\r\n")
        t0 = time.monotonic()
        r = await c.response()
        assert r.status == 408
        assert time.monotonic() - t0 >= 0.8 * 0.5  # not at the first-byte timeout
        assert await c.closed()


async def test_the_gateway_setting_reaches_its_client_port():
    with sim_engine(model="sim-model", time_scale=50) as eng:
        async with running_gateway(eng, server={"first_byte_timeout_s": 0.3, "header_timeout_s": 5.0}) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                t0 = time.monotonic()
                assert await asyncio.wait_for(reader.read(), 5.0) == b""
                assert time.monotonic() - t0 <= 0.3 * 8
            finally:
                writer.close()
            # a client that sends at once is served as ever
            r = await http_request(
                gw.port, "POST", "/v1/completions", {"model": "sim-model", "prompt": "x", "max_tokens": 2}
            )
            assert r.status == 200
