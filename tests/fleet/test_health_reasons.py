"""What the health monitor says: each transition once, with its reason (connection refused,
no answer in time, the HTTP status), and an endpoint whose engine does not serve the model
it is configured for is named as such and kept out of routing."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from tests.support.gateway import ScriptedServer, running_gateway, wait_until
from tests.support.sim import http_request, sim_engine


@pytest.fixture(scope="module")
def llama():
    with sim_engine(model="llama", time_scale=10) as e:
        yield e


def _lines(caplog, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "velocity.health" and r.getMessage().startswith(f"endpoint {name}:")
    ]


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_model_the_engine_does_not_serve_is_said_once_and_not_routed(llama, caplog):
    caplog.set_level(logging.INFO, logger="velocity.health")
    async with running_gateway(("a", llama.url, "llama"), ("b", llama.url, "wrongname"), healthy=1) as gw:
        b = gw.endpoints["b"]
        await wait_until(lambda: b.state == "unserved", 5.0, what="b unserved")
        await asyncio.sleep(0.6)  # several checks of b (every 100 ms): still one line
        (line,) = _lines(caplog, "b")
        assert line.startswith(
            "endpoint b: unknown -> unserved: model 'wrongname' not served; the engine serves 'llama'"
        )
        assert "--endpoint b=URL=MODEL" in line and "--served-model-name wrongname" in line
        assert not b.healthy and gw.endpoints["a"].healthy

        r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat("wrongname"))
        assert r.status == 503, r.body  # the gateway's own answer, not the engine's 404
        assert (await http_request(gw.port, "POST", "/v1/chat/completions", _chat("llama"))).status == 200

        stats = {e["name"]: e for e in gw.stats()["endpoints"]}
        assert stats["b"]["state"] == "unserved" and "not served" in stats["b"]["reason"]
        assert stats["a"]["state"] == "healthy" and stats["a"]["reason"] is None


class _Hanging(ScriptedServer):
    """Accepts, reads, never answers."""

    async def _serve(self, reader, writer) -> None:
        await self.read_request(reader)
        await asyncio.sleep(3600)


class _Unavailable(ScriptedServer):
    """/health answers 503, as vLLM does while it loads."""

    async def _serve(self, reader, writer) -> None:
        while True:
            await self.read_request(reader)
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_each_transition_says_why_once(llama, caplog):
    caplog.set_level(logging.INFO, logger="velocity.health")
    async with _Hanging() as hanging, _Unavailable() as unavailable:
        refused = f"http://127.0.0.1:{_closed_port()}"
        async with running_gateway(
            ("a", llama.url, "llama"),
            ("r", refused, "llama"),
            ("t", hanging.url, "llama"),
            ("s", unavailable.url, "llama"),
            healthy=1,
        ) as gw:
            await wait_until(lambda: all(gw.endpoints[n].state == "down" for n in "rts"), 5.0, what="down")
            await asyncio.sleep(1.2)  # more checks of each: no more lines
            assert _lines(caplog, "r") == ["endpoint r: unknown -> down: health check: connection refused"]
            assert _lines(caplog, "t") == ["endpoint t: unknown -> down: health check: no answer within 500 ms"]
            assert _lines(caplog, "s") == ["endpoint s: unknown -> down: health check: /health answered HTTP 503"]
            reasons = {e["name"]: e["reason"] for e in gw.stats()["endpoints"]}
            assert reasons["r"] == "health check: connection refused"


async def test_an_ejection_says_why_in_one_line(caplog):
    caplog.set_level(logging.INFO, logger="velocity.health")
    with sim_engine(model="llama", time_scale=10) as eng:
        async with running_gateway(("a", eng.url, "llama")) as gw:
            eng.stop()
            await wait_until(lambda: gw.endpoints["a"].state == "ejected", 5.0, what="ejected")
            await asyncio.sleep(0.5)
    lines = _lines(caplog, "a")
    assert lines[0] == "endpoint a: unknown -> healthy"
    assert len(lines) == 2, lines
    assert lines[1].startswith("endpoint a: healthy -> ejected: ")
    assert "connection refused" in lines[1] or "connect error" in lines[1]
    assert "checked again in 0.2s" in lines[1]
