"""Cancellation and engine failure through the gateway (docs/design.md, "The life of one request"):
a client that leaves frees the engine, streaming or not, also before the first token;
an engine killed mid-stream ends the stream the vLLM way, is ejected, and comes back."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import http_request, open_request, start_sim_engine

MODEL = "sim-model"


def running(eng) -> float:
    return eng.metric("vllm:num_requests_running")


async def engine_running_is(eng, value: float, timeout: float = 5.0) -> None:
    # The engine's /metrics is read off the loop: the gateway under test shares it.
    async def check():
        return await asyncio.to_thread(running, eng) == value

    await wait_until(check, timeout, interval=0.05, what=f"vllm:num_requests_running == {value}")


async def outcomes(gw) -> dict[str, float]:
    """The gateway's admitted/completed/failed/cancelled counters from admin /metrics."""
    text = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for kind in ("admitted", "completed", "failed", "cancelled"):
            if fam.name == f"velocity_{kind}":
                out[kind] = sum(smp.value for smp in fam.samples)
    return out


async def reconciled(gw, **expect: float) -> None:
    """Every admitted request ended in exactly one outcome (nothing in flight now)."""

    async def check():
        o = await outcomes(gw)
        return o["admitted"] == o["completed"] + o["failed"] + o["cancelled"]

    await wait_until(check, 3.0, what="admitted == completed + failed + cancelled")
    o = await outcomes(gw)
    for k, v in expect.items():
        assert o[k] == v, (k, o)


@pytest.fixture
def slow_engine():
    # Real-time decode (50 tokens/s) and a slow prefill (100 tokens/s, ~25 bytes per 0.25 s):
    # a long request stays in flight for seconds, a long prompt holds it before its first token.
    eng = start_sim_engine("--prefill-tps", "100", model=MODEL, time_scale=1)
    yield eng
    eng.stop()


async def send_raw(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer


async def test_disconnect_mid_stream_frees_the_engine(slow_engine):
    async with running_gateway(slow_engine) as gw:
        s = await open_request(
            gw.port,
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1000, "stream": True},
        )
        assert s.status == 200
        got = 0
        async for ev in s.events():
            if ev.startswith("{"):
                got += 1
            if got >= 3:
                break
        assert await asyncio.to_thread(running, slow_engine) == 1
        s.abort()
        await engine_running_is(slow_engine, 0)
        await wait_until(lambda: gw.endpoints["e1"].inflight == 0, 2.0, what="gateway in-flight back to 0")
        await reconciled(gw, admitted=1, cancelled=1)


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_while_waiting_frees_the_engine(slow_engine, stream):
    async with running_gateway(slow_engine) as gw:
        _, writer = await send_raw(gw.port, {"model": MODEL, "prompt": "tell me", "max_tokens": 1000, "stream": stream})
        try:
            await engine_running_is(slow_engine, 1)
            await asyncio.sleep(0.2)  # decoding, the answer not finished
        finally:
            writer.transport.abort()
        t0 = time.monotonic()
        await engine_running_is(slow_engine, 0)
        assert time.monotonic() - t0 < 5.0  # far below the 20 s the request would have taken
        await reconciled(gw, admitted=1, cancelled=1)


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_before_the_first_token_frees_the_engine(slow_engine, stream):
    async with running_gateway(slow_engine) as gw:
        # ~1000 prompt tokens at 100 tokens/s: ten seconds of prefill before any token.
        reader, writer = await send_raw(
            gw.port, {"model": MODEL, "prompt": "lorem ipsum " * 330, "max_tokens": 5, "stream": stream}
        )
        try:
            await engine_running_is(slow_engine, 1)
            # No token yet: at most the head of a stream has come back.
            try:
                early = await asyncio.wait_for(reader.read(65536), 0.3)
            except TimeoutError:
                early = b""
            assert b"data: {" not in early
            if not stream:
                assert early == b""
        finally:
            writer.transport.abort()
        await engine_running_is(slow_engine, 0)
        await reconciled(gw, admitted=1, cancelled=1)


async def test_engine_killed_mid_stream_then_ejected_and_readmitted():
    e1 = start_sim_engine(model=MODEL, time_scale=1)
    e2 = start_sim_engine(model=MODEL, time_scale=1)
    engines = {"e1": e1, "e2": e2}
    try:
        async with running_gateway(e1, e2) as gw:
            s = await open_request(
                gw.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "go", "max_tokens": 500, "stream": True}
            )
            assert s.status == 200
            victim_name = s.headers["x-velocity-endpoint"]
            other_name = "e2" if victim_name == "e1" else "e1"
            victim = engines[victim_name]
            events = []
            killed = False

            async def read_stream() -> None:
                nonlocal killed
                async for ev in s.events():
                    events.append(ev)
                    if len(events) == 3 and not killed:
                        victim.proc.kill()
                        killed = True
                    assert len(events) < 600

            # A stream the gateway never finished would otherwise hang here silently.
            try:
                await asyncio.wait_for(read_stream(), 30)
            except asyncio.TimeoutError:
                st = (await http_request(gw.admin_port, "GET", "/stats")).json()
                pytest.fail(f"the stream never ended after the engine died; events {events[-3:]}, stats {st}")
            await s.close()
            assert killed
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])
            assert set(err) == {"error"}
            assert err["error"]["message"] and err["error"]["code"] >= 500

            for _ in range(4):
                r = await http_request(
                    gw.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "next", "max_tokens": 3}
                )
                assert r.status == 200
                assert r.headers["x-velocity-endpoint"] == other_name

            async def healthy_in_stats(want: bool):
                st = (await http_request(gw.admin_port, "GET", "/stats")).json()
                return {e["name"]: e["healthy"] for e in st["endpoints"]}[victim_name] is want

            await wait_until(lambda: healthy_in_stats(False), 5.0, what="the dead engine ejected")
            restarted = start_sim_engine(model=MODEL, time_scale=1, port=victim.port)
            engines[victim_name + "-restarted"] = restarted
            await wait_until(lambda: healthy_in_stats(True), 10.0, what="the restarted engine readmitted")
            seen = set()
            for _ in range(20):
                r = await http_request(
                    gw.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 2}
                )
                assert r.status == 200
                seen.add(r.headers["x-velocity-endpoint"])
                if seen == {"e1", "e2"}:
                    break
            assert seen == {"e1", "e2"}, "both engines serve again"
            await reconciled(gw, failed=1, cancelled=0)
    finally:
        for eng in engines.values():
            eng.stop()


async def test_engine_killed_during_a_non_streamed_answer_is_502(slow_engine):
    async with running_gateway(slow_engine) as gw:
        pending = asyncio.ensure_future(
            http_request(gw.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "go", "max_tokens": 500})
        )
        try:
            await engine_running_is(slow_engine, 1)
            slow_engine.proc.kill()
            slow_engine.proc.wait(5)
            r = await asyncio.wait_for(pending, 10)
        finally:
            if not pending.done():
                pending.cancel()
        assert r.status == 502
        assert r.headers["x-velocity-reject-reason"] == "upstream"
        assert r.json()["error"]["code"] == 502
        assert r.headers["x-request-id"].startswith("req-")
        assert gw.endpoints["e1"].inflight == 0
        await reconciled(gw, admitted=1, failed=1)


async def test_an_error_event_inside_a_stream_fails_the_request_not_just_the_status():
    # With --oom-rate 1.0 the engine fails every request: some with a 500 before the
    # stream, some with vLLM's error event inside a 200 stream. The second kind must be
    # booked as failed too (the gateway finds the event in the relayed bytes).
    eng = start_sim_engine("--oom-rate", "1.0", model=MODEL, time_scale=50)
    try:
        async with running_gateway(eng) as gw:
            in_stream = sent = 0
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
            while in_stream < 2 and sent < 40:
                sent += 1
                # high: out-of-memory shedding spares band 0, so every request reaches the engine
                r = await http_request(
                    gw.port,
                    "POST",
                    "/v1/chat/completions",
                    {**body, "messages": [{"role": "user", "content": f"m{sent}"}]},
                    {"x-velocity-priority": "high"},
                )
                if r.status == 200:
                    assert b'data: {"error"' in r.body and r.body.rstrip().endswith(b"data: [DONE]")
                    in_stream += 1
                else:
                    assert r.status >= 500
            assert in_stream == 2
            await reconciled(gw, completed=0, failed=sent)
    finally:
        eng.stop()
