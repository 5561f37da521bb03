"""VELOCITY_IO=asyncio on the engine side too, the `velocityllm sim-engine` subcommand, and
the client port's /health staying 200 ("degraded") with no healthy engine."""

from __future__ import annotations

import json
import time
from urllib.request import Request, urlopen

import pytest

from tests.support.gateway import gateway_process, running_gateway, velocity_command, wait_until
from tests.support.sim import SimEngine, free_port, http_request, open_request, sim_engine, start_sim_engine

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}


def _post(url: str, body: dict, timeout: float = 15.0) -> tuple[int, dict, bytes]:
    req = Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urlopen(req, timeout=timeout) as r:
        return r.status, dict(r.headers), r.read()


# -- VELOCITY_IO -----------------------------------------------------------------------------


def _engine_transports(gw) -> set[str]:
    return {type(c.transport).__name__ for ep in gw.endpoints.values() for c in ep.upstream._all}


@pytest.mark.parametrize("io,fd", [("asyncio", False), ("epoll", True)])
async def test_engine_connections_use_the_loops_transports_under_velocity_io_asyncio(monkeypatch, io, fd):
    monkeypatch.setenv("VELOCITY_IO", io)
    with sim_engine(model="m1", time_scale=50) as eng:
        async with running_gateway(eng) as gw:
            r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
            assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 5
            s = await open_request(gw.port, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
            events = [ev async for ev in s.events()]
            await s.close()
            assert s.status == 200 and events[-1] == "[DONE]"
            kinds = _engine_transports(gw)
            assert kinds  # the proxied requests' connections (and the health checks')
            assert ("FdTransport" in kinds) is fd
            assert all(k == "FdTransport" for k in kinds) is fd


def test_a_gateway_started_with_velocity_io_asyncio_proxies_end_to_end():
    with sim_engine(model="m1", time_scale=50) as eng:
        with gateway_process("serve", "--endpoint", f"e1={eng.url}=m1", env={"VELOCITY_IO": "asyncio"}) as gp:
            deadline = time.monotonic() + 10
            while json.loads(urlopen(gp.url + "/health", timeout=5).read())["status"] != "ok":
                assert time.monotonic() < deadline, "the engine never became healthy"
                time.sleep(0.05)
            status, headers, body = _post(gp.url + "/v1/chat/completions", CHAT)
            assert status == 200 and headers["x-velocity-endpoint"] == "e1"
            assert json.loads(body)["usage"]["completion_tokens"] == 5
            status, _, body = _post(
                gp.url + "/v1/completions", {"model": "m1", "prompt": "once upon", "max_tokens": 4, "stream": True}
            )
            lines = [ln for ln in body.decode().splitlines() if ln.startswith("data: ")]
            assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) >= 5


# -- velocityllm sim-engine ----------------------------------------------------------------------


class SubcommandEngine(SimEngine):
    """A sim engine started as `velocityllm sim-engine` (the CLI's subcommand)."""

    def command(self) -> list[str]:
        return velocity_command(
            "sim-engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            self.model,
            "--time-scale",
            "50",
            *self.flags,
        )


def test_the_sim_engine_subcommand_serves_health_and_completions_and_stops():
    port = free_port()
    eng = SubcommandEngine("--max-num-seqs", "4", model="sub-model", port=port).start()
    try:
        assert eng.port == port
        status, body = eng.get("/health")
        assert status == 200
        status, body = eng.get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "sub-model"
        status, _, out = _post(eng.url + "/v1/completions", {"model": "sub-model", "prompt": "hi", "max_tokens": 3})
        assert status == 200 and json.loads(out)["usage"]["completion_tokens"] == 3
        assert eng.metric("vllm:num_requests_running") == 0
    finally:
        code = eng.stop()
    assert code == 0, eng.stderr_text
    with pytest.raises(OSError):
        urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


# -- /health while degraded --------------------------------------------------------------------


async def test_health_stays_200_and_says_degraded_without_a_healthy_engine():
    eng = start_sim_engine(model="m1", time_scale=50)
    stopped = False
    try:
        async with running_gateway(eng) as gw:
            r = await http_request(gw.port, "GET", "/health")
            assert r.status == 200 and r.json()["status"] == "ok" and r.json()["healthy_endpoints"] == 1
            eng.stop()
            stopped = True
            await wait_until(lambda: not gw.endpoints["e1"].healthy, 5.0, what="the engine seen down")
            r = await http_request(gw.port, "GET", "/health")
            assert r.status == 200  # liveness: the gateway itself is fine
            assert r.json()["status"] == "degraded" and r.json()["healthy_endpoints"] == 0
            # Readiness, on the admin port, says it is not ready; requests get 503 no-endpoint.
            assert (await http_request(gw.admin_port, "GET", "/ready")).status == 503
            r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
            assert (r.status, r.headers["x-velocity-reject-reason"]) == (503, "no-endpoint")
    finally:
        if not stopped:
            eng.stop()
