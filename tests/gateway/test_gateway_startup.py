"""The gateway routes to an engine once it has answered a health check, at start and on reload
(docs/design.md, "Admission"): a request sent the moment the gateway is up, or the moment
a reload is done, reaches an engine that is up; an engine that never answers delays
either by no more than the check's timeout."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.support.gateway import RecordingUpstream, ScriptedServer, gateway_settings
from tests.support.sim import http_request
from velocity_fast.gateway.app import Gateway
from velocity_fast.gateway.reload import Reloader

MODEL = "m1"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()


class SlowHealthEngine(RecordingUpstream):
    """A recording engine whose /health takes ``delay`` seconds (None: never answers)."""

    def __init__(self, delay: float | None) -> None:
        super().__init__()
        self.delay = delay

    async def _serve(self, reader, writer):
        while True:
            method, path, _, body = await self.read_request(reader)
            if path == "/health":
                if self.delay is None:
                    await asyncio.Event().wait()
                await asyncio.sleep(self.delay)
                out, ct = b"", "text/plain"
            elif path == "/metrics":
                out, ct = b"vllm:num_requests_running 0\n", "text/plain"
            else:
                self.requests.append((method, path, {}, body))
                out, ct = self.reply, "application/json"
            writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: {ct}\r\ncontent-length: {len(out)}\r\n\r\n".encode() + out)
            await writer.drain()


@pytest.mark.timeout(30)
async def test_a_request_sent_the_moment_the_gateway_starts_reaches_its_engine():
    # Default health settings (no test's fast checks): the engine takes 300 ms to answer
    # its first check. Before, the port opened at once and the request met "unknown"
    # engines: 503 no-endpoint.
    async with SlowHealthEngine(0.3) as eng:
        s = gateway_settings(("e1", eng.url, MODEL), health={})
        gw = Gateway(s)
        try:
            await gw.start("127.0.0.1", 0, 0)
            r = await http_request(
                gw.port, "POST", "/v1/chat/completions", CHAT, headers={"content-type": "application/json"}
            )
            assert r.status == 200, r.body
            # (the monitor also asks /v1/models once, for the engine's context length)
            assert [p for _, p, _, _ in eng.requests if p != "/v1/models"] == ["/v1/chat/completions"]
        finally:
            await gw.stop(grace=1.0)


@pytest.mark.timeout(30)
async def test_ready_waits_for_the_client_port_when_one_engine_passes_before_another():
    # e1 answers its first check at once, e2 after 400 ms: the client port opens after
    # both, so /ready must not say 200 in between (a client polling it would find the
    # port closed).
    async with RecordingUpstream() as fast, SlowHealthEngine(0.4) as slow:
        s = gateway_settings(("e1", fast.url, MODEL), ("e2", slow.url, MODEL), health={})
        gw = Gateway(s)
        starting = asyncio.get_running_loop().create_task(gw.start("127.0.0.1", 0, 0))
        try:
            seen = []
            while True:
                if gw.admin_server is not None and gw.admin_port:
                    r = await http_request(gw.admin_port, "GET", "/ready")
                    seen.append((r.status, json.loads(r.body)["healthy_endpoints"]))
                    if r.status == 200:
                        break
                assert not starting.done() or gw.port, "start() ended without /ready"
                await asyncio.sleep(0.01)
            # Ready means the client port takes requests now.
            r = await http_request(
                gw.port, "POST", "/v1/chat/completions", CHAT, headers={"content-type": "application/json"}
            )
            assert r.status == 200, r.body
            # e1 was healthy while e2 was still being asked, and /ready said 503 then.
            assert (503, 1) in seen, seen
            await starting
        finally:
            if not starting.done():
                starting.cancel()
            await gw.stop(grace=1.0)


@pytest.mark.timeout(30)
async def test_an_engine_that_never_answers_delays_the_start_by_the_check_timeout_only():
    async with SlowHealthEngine(None) as eng:
        s = gateway_settings(("e1", eng.url, MODEL), health={"check_timeout_ms": 400})
        gw = Gateway(s)
        try:
            t0 = time.monotonic()
            await gw.start("127.0.0.1", 0, 0)
            took = time.monotonic() - t0
            assert 0.3 < took < 3.0, took
            r = await http_request(
                gw.port, "POST", "/v1/chat/completions", CHAT, headers={"content-type": "application/json"}
            )
            assert r.status == 503, r.body
            assert json.loads(r.body)["error"]["type"]
            assert r.headers.get("retry-after") == "1"
        finally:
            await gw.stop(grace=1.0)


class GarbageEngine(ScriptedServer):
    """Answers anything with bytes that are not HTTP, then hangs up."""

    async def _serve(self, reader, writer):
        await self.read_request(reader)
        writer.write(b"SSH-2.0-not-an-engine\r\n\r\n")
        await writer.drain()


@pytest.mark.timeout(30)
async def test_a_model_added_by_reload_serves_as_soon_as_the_reload_is_done():
    # The new engine takes 300 ms to answer /health: without the check before the swap,
    # a request right after the reload met an endpoint nobody had checked (503).
    async with (
        RecordingUpstream() as old,
        SlowHealthEngine(0.3) as new,
        SlowHealthEngine(None) as dead,
        GarbageEngine() as garbage,
    ):
        s = gateway_settings(("e1", old.url, MODEL), health={"check_timeout_ms": 600})
        gw = Gateway(s)
        reloader = Reloader(
            gw,
            lambda: gateway_settings(
                ("e1", old.url, MODEL),
                ("e2", new.url, "m2"),
                ("e3", dead.url, "m3"),
                ("e4", garbage.url, "m4"),
                health={"check_timeout_ms": 600},
            ),
        )
        try:
            await gw.start("127.0.0.1", 0, 0)
            t0 = time.monotonic()
            assert await reloader.reload()
            assert time.monotonic() - t0 < 3.0  # an engine that never answers costs the timeout only
            body = json.dumps({"model": "m2", "messages": [{"role": "user", "content": "hi"}]}).encode()
            r = await http_request(
                gw.port, "POST", "/v1/chat/completions", body, headers={"content-type": "application/json"}
            )
            assert r.status == 200, r.body
            assert r.headers["x-velocity-endpoint"] == "e2" and len(new.requests) == 1
            # Those that did not answer, or not in HTTP, are not routed to before their own
            # checks pass; the reload took the rest all the same.
            assert gw.endpoints["e3"].state != "healthy" and gw.endpoints["e4"].state != "healthy"
            body = json.dumps({"model": "m3", "messages": [{"role": "user", "content": "hi"}]}).encode()
            r = await http_request(
                gw.port, "POST", "/v1/chat/completions", body, headers={"content-type": "application/json"}
            )
            assert r.status == 503 and json.loads(r.body)["error"]["type"]
        finally:
            reloader.close()
            await gw.stop(grace=1.0)
