"""OpenTelemetry tracing (docs/tracing.md) against a real OTLP/HTTP receiver: an HTTP
server in the test that decodes the ``ExportTraceServiceRequest`` protobuf the SDK's
exporter posts to /v1/traces. The span tree, its attributes, the W3C context joined,
returned and sent to the engine; a collector that is down costs the requests nothing."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.support.otlp import CLIENT, SERVER, Receiver, need_otel

need_otel()

from tests.support.gateway import RecordingUpstream, gateway_settings, running_gateway, wait_until  # noqa: E402
from tests.support.sim import free_port, http_request, open_request, sim_engine  # noqa: E402

pytestmark = pytest.mark.timeout(60)


REPLY = json.dumps(
    {
        "id": "cmpl-1",
        "object": "chat.completion",
        "model": "m-served",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }
).encode()


def _tracing(url: str, **more) -> dict:
    return {"sample_ratio": 1.0, "otlp_endpoint": url, **more}


def _tree(spans: list[dict], trace_id: str) -> tuple[dict, dict[str, list[dict]]]:
    mine = [s for s in spans if s["trace_id"] == trace_id]
    (server,) = [s for s in mine if s["kind"] == SERVER]
    children: dict[str, list[dict]] = {}
    for s in mine:
        if s is not server:
            assert s["parent"] == server["span_id"], s
            children.setdefault(s["name"], []).append(s)
    return server, children


async def test_span_tree_joins_the_callers_trace_and_reaches_the_engine():
    """A request with a caller's traceparent: one server span in the caller's trace, its
    parent the caller's span; admission.wait, route and one client span beneath it; the
    engine got a traceparent naming the client span; the answer names the server span."""
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with Receiver() as rx:
        async with RecordingUpstream(reply=REPLY) as up:
            async with running_gateway(("e1", up.url, "m"), tracing=_tracing(rx.url)) as gw:
                r = await http_request(
                    gw.port,
                    "POST",
                    "/v1/chat/completions",
                    {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 7},
                    headers={
                        "traceparent": f"00-{caller_trace}-{caller_span}-01",
                        "tracestate": "vendor=x",
                        "x-velocity-tenant": "alice",
                    },
                )
                assert r.status == 200, r.body
        # the gateway's stop exported what was queued
    version, trace_id, server_id, flags = r.headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", caller_trace, "01")
    server, children = _tree(rx.spans, caller_trace)
    assert server["span_id"] == server_id and server["parent"] == caller_span
    assert server["name"] == "chat m"
    assert server["resource"]["service.name"] == "velocityllm"
    a = server["attrs"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "m"
    assert a["gen_ai.response.model"] == "m-served"
    assert a["gen_ai.request.max_tokens"] == 7
    assert a["gen_ai.usage.input_tokens"] == 11 and a["gen_ai.usage.output_tokens"] == 7
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["http.response.status_code"] == 200
    assert a["velocity.tenant"] == "alice" and a["velocity.band"] == "normal"
    assert "velocity.decline_reason" not in a
    assert sorted(children) == ["admission.wait", "chat m", "route"]
    (wait,) = children["admission.wait"]
    assert wait["attrs"]["velocity.band"] == "normal" and wait["attrs"]["velocity.wait_ms"] >= 0
    (route,) = children["route"]
    assert route["attrs"]["velocity.endpoint"] == "e1" and route["attrs"]["velocity.route.profile"] == "chat"
    assert route["attrs"]["velocity.route.basis"] == "only"  # one engine: no choice made
    (client,) = children["chat m"]
    assert client["kind"] == CLIENT
    assert client["attrs"]["velocity.endpoint"] == "e1" and client["attrs"]["velocity.retry"] == 0
    assert client["attrs"]["http.response.status_code"] == 200
    # the spans nest in time: each child within the server span
    for s in (wait, route, client):
        assert server["start"] <= s["start"] <= s["end"] <= server["end"], s
    assert wait["end"] <= route["start"] <= client["start"]
    # what the engine received: the client span as its parent, in the caller's trace
    (engine_headers,) = [h for _, path, h, _ in up.requests if path == "/v1/chat/completions"]
    assert engine_headers["traceparent"] == f"00-{caller_trace}-{client['span_id']}-01"


async def test_stream_from_the_sim_engine_and_a_new_trace(monkeypatch):
    """A stream from the sim engine, no caller context: a new trace, exported in the
    background while the gateway runs (a short batch delay); the client span's TTFT, the
    finish reasons and the usage read from the stream's chunks."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with Receiver() as rx, sim_engine(model="sim-model") as eng:
        async with running_gateway(eng, tracing=_tracing(rx.url)) as gw:
            s = await open_request(
                gw.port,
                "POST",
                "/v1/completions",
                {
                    "model": "sim-model",
                    "prompt": "once upon a time",
                    "max_tokens": 5,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            try:
                assert s.status == 200
                await s.body()
            finally:
                await s.close()
            trace_id = s.headers["traceparent"].split("-")[1]
            await wait_until(lambda: any(x["kind"] == SERVER for x in rx.spans), 10.0, what="the server span exported")
    server, children = _tree(rx.spans, trace_id)
    assert server["name"] == "text_completion sim-model" and server["parent"] == ""
    a = server["attrs"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    (client,) = children["text_completion sim-model"]
    assert 0 < client["attrs"]["velocity.ttft_ms"] < (client["end"] - client["start"]) / 1e6


async def test_not_sampled_changes_nothing():
    """A caller's traceparent that says not sampled: no traceparent back, none sent to the
    engine, no span exported."""
    with Receiver() as rx:
        async with RecordingUpstream(reply=REPLY) as up:
            async with running_gateway(("e1", up.url, "m"), tracing=_tracing(rx.url)) as gw:
                r = await http_request(
                    gw.port,
                    "POST",
                    "/v1/chat/completions",
                    {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                    headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"},
                )
                assert r.status == 200
    assert "traceparent" not in r.headers
    assert [h for _, path, h, _ in up.requests if path == "/v1/chat/completions" and "traceparent" in h] == []
    assert any(path == "/v1/chat/completions" for _, path, _, _ in up.requests)
    assert rx.spans == []


async def test_a_decline_is_traced_with_its_reason_and_retry_after():
    """A request no engine can take (its only engine is down): 503 no-endpoint; the trace
    says why, with the Retry-After promised, and the answer carries its traceparent."""
    port = free_port()  # nothing listens there
    with Receiver() as rx:
        async with running_gateway(("e1", f"http://127.0.0.1:{port}", "m"), healthy=0, tracing=_tracing(rx.url)) as gw:
            r = await http_request(
                gw.port, "POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            )
    assert r.status == 503, r.body
    trace_id = r.headers["traceparent"].split("-")[1]
    server, children = _tree(rx.spans, trace_id)
    assert server["attrs"]["http.response.status_code"] == 503
    assert server["attrs"]["velocity.decline_reason"] == "no-endpoint"
    assert server["error"]
    (wait,) = children["admission.wait"]
    assert wait["attrs"]["velocity.retry_after_s"] == 1.0


@pytest.mark.timed
async def test_collector_down_costs_the_requests_nothing_and_stays_bounded():
    """No collector listening: every request still answers, about as fast as with tracing
    off on the same engine, and the exporter's queue never holds more than its bound."""
    dead = f"http://127.0.0.1:{free_port()}"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    n = 200

    async def run(gw) -> float:
        t = time.monotonic()
        for _ in range(n):
            r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
            assert r.status == 200
        return time.monotonic() - t

    async with RecordingUpstream(reply=REPLY) as up:
        async with running_gateway(("e1", up.url, "m")) as gw:
            await run(gw)  # warm
            off = await run(gw)
        async with running_gateway(("e1", up.url, "m"), tracing=_tracing(dead, max_queue_size=64)) as gw:
            t0 = time.monotonic()
            on = await run(gw)
            queue = gw.tracing.processor._batch_processor._queue
            assert len(queue) <= 64
            stop_at = time.monotonic()
        stopped_in = time.monotonic() - stop_at
    # each traced request makes four spans: 800 spans met a queue of 64 and a dead collector
    assert on < off * 3 + 0.5, (on, off)
    assert stopped_in < 10.0, stopped_in  # the stop waits for the exporter at most its bound
    assert time.monotonic() - t0 < 30.0


async def test_the_ratio_samples_a_share_and_an_invalid_traceparent_starts_a_trace():
    """At ratio 0.5 about half of 100 requests are traced (each traced one answers with its
    traceparent and has its server span); a malformed caller context is not joined: the
    request starts a trace of its own, sampled as any other."""
    with Receiver() as rx:
        async with RecordingUpstream(reply=REPLY) as up:
            async with running_gateway(("e1", up.url, "m"), tracing=_tracing(rx.url, sample_ratio=0.5)) as gw:
                traced = []
                for i in range(100):
                    r = await http_request(
                        gw.port,
                        "POST",
                        "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                        headers={"traceparent": "00-zzzz-00f067aa0ba902b7-01"} if i % 2 else None,
                    )
                    assert r.status == 200
                    if "traceparent" in r.headers:
                        traced.append(r.headers["traceparent"].split("-")[1])
    assert 20 <= len(traced) <= 80, len(traced)
    servers = {s["trace_id"]: s for s in rx.spans if s["kind"] == SERVER}
    assert set(servers) == set(traced)
    assert all(s["parent"] == "" for s in servers.values())


async def test_a_reload_that_turns_tracing_on_says_it_waits_for_the_next_start(caplog):
    """Tracing is read once at start: a reload that turns it on is reported key by key as
    taking effect at the next start, and requests stay untraced until then."""
    import logging

    from tests.support.gateway import gateway_settings
    from velocity_fast.gateway.reload import apply_settings

    with Receiver() as rx:
        async with RecordingUpstream(reply=REPLY) as up:
            async with running_gateway(("e1", up.url, "m")) as gw:
                new = gateway_settings(("e1", up.url, "m"), tracing=_tracing(rx.url))
                with caplog.at_level(logging.WARNING, logger="velocity.reload"):
                    apply_settings(gw, new)
                warned = sorted(r.getMessage() for r in caplog.records if r.name == "velocity.reload")
                assert warned == [
                    f"config reload: tracing.{k} changed; it takes effect at the next start"
                    for k in ("otlp_endpoint", "sample_ratio")
                ]
                r = await http_request(
                    gw.port,
                    "POST",
                    "/v1/chat/completions",
                    {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                )
                assert r.status == 200 and "traceparent" not in r.headers
    assert rx.spans == []


async def test_a_retry_on_another_engine_is_a_second_client_span():
    """An engine gone: the request that met it is retried on the other; its trace holds
    two route spans and two client spans, the first failed (retry 0, the dead engine),
    the second answered (retry 1), and the engine that answered got the second's id."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with Receiver() as rx:
        async with RecordingUpstream(reply=REPLY) as good:
            bad = await RecordingUpstream(reply=REPLY).__aenter__()
            try:
                health = {"check_interval_ms": 60000.0, "scrape_interval_ms": 60000.0}
                async with running_gateway(
                    ("e1", bad.url, "m"), ("e2", good.url, "m"), health=health, tracing=_tracing(rx.url)
                ) as gw:
                    await bad.__aexit__(None, None, None)
                    for _ in range(30):
                        r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
                        assert r.status == 200 and r.headers["x-velocity-endpoint"] == "e2"
                        if not gw.endpoints["e1"].healthy:
                            break
                    assert not gw.endpoints["e1"].healthy
                    _, retried, _, flags = r.headers["traceparent"].split("-")
            finally:
                await bad.__aexit__(None, None, None)
    server, children = _tree(rx.spans, retried)
    first, second = sorted(children["chat m"], key=lambda s: s["start"])
    assert (first["attrs"]["velocity.endpoint"], first["attrs"]["velocity.retry"], first["error"]) == ("e1", 0, True)
    assert (second["attrs"]["velocity.endpoint"], second["attrs"]["velocity.retry"], second["error"]) == (
        "e2",
        1,
        False,
    )
    assert first["end"] <= second["start"]
    assert [s["attrs"]["velocity.endpoint"] for s in sorted(children["route"], key=lambda s: s["start"])] == [
        "e1",
        "e2",
    ]
    sent = [h["traceparent"] for _, path, h, _ in good.requests if path == "/v1/chat/completions"]
    assert f"00-{retried}-{second['span_id']}-{flags}" in sent


async def test_a_queued_wait_and_an_sla_decline_are_traced():
    """One engine slot, busy: a request with a long SLA queues (its admission.wait spans
    the queue wait, with the wait predicted at arrival); one under the server's 100 ms
    SLA is declined at once (429 sla) and its trace says so, with the Retry-After
    promised."""
    import asyncio

    long_sla = {"x-velocity-sla-ms": "60000"}

    async def completion(headers=None, max_tokens=40):
        body = {"model": "m1", "prompt": "hello there", "max_tokens": max_tokens}
        return await http_request(gw.port, "POST", "/v1/completions", body, headers=headers, timeout=30)

    with Receiver() as rx, sim_engine(model="m1", time_scale=4) as eng:
        async with running_gateway(
            eng, max_concurrency=1, sla_ms=100.0, policy="dynamic", tracing=_tracing(rx.url)
        ) as gw:
            for _ in range(3):  # the engine's pace, learned
                assert (await completion(long_sla)).status == 200
            busy = asyncio.create_task(completion(long_sla, max_tokens=200))
            await wait_until(lambda: gw.admission.stats()["counters"]["in_flight"] == 1, 5.0, what="busy")
            queued = asyncio.create_task(completion(long_sla))
            await wait_until(lambda: gw.admission.stats()["queued"] == 1, 5.0, what="queued")
            declined = await completion()
            assert (declined.status, declined.headers["x-velocity-reject-reason"]) == (429, "sla")
            waited = await queued
            assert (await busy).status == 200 and waited.status == 200
    server, children = _tree(rx.spans, declined.headers["traceparent"].split("-")[1])
    assert server["attrs"]["velocity.decline_reason"] == "sla"
    assert server["attrs"]["http.response.status_code"] == 429
    assert sorted(children) == ["admission.wait"]  # never routed
    (wait,) = children["admission.wait"]
    assert wait["attrs"]["velocity.decline_reason"] == "sla" and wait["error"]
    # the promise itself; the header rounds it up to whole seconds
    assert math.ceil(wait["attrs"]["velocity.retry_after_s"]) == int(declined.headers["retry-after"])
    assert wait["attrs"]["velocity.predicted_wait_ms"] > 0
    assert wait["attrs"]["velocity.queued_ahead"] == 1  # the queued request, in the same band
    server, children = _tree(rx.spans, waited.headers["traceparent"].split("-")[1])
    (wait,) = children["admission.wait"]
    queue_ms = float(waited.headers["x-velocity-queue-ms"])
    assert queue_ms > 10 and abs(wait["attrs"]["velocity.wait_ms"] - queue_ms) < 1.0
    assert (wait["end"] - wait["start"]) / 1e6 == pytest.approx(queue_ms, abs=1.0)
    assert wait["attrs"]["velocity.predicted_wait_ms"] > 0
    assert wait["attrs"]["velocity.queued_ahead"] == 0  # the busy one runs: none waited before it


async def test_the_route_span_says_how_much_of_the_prompt_the_engine_holds():
    """The same long prompt twice: the first pick finds none of its blocks on the engine,
    the second finds those the first sent (the gateway's prefix index)."""
    prompt = "You are a careful assistant. " * 40
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 3}
    with Receiver() as rx:
        async with RecordingUpstream(reply=REPLY) as up:
            async with running_gateway(("e1", up.url, "m"), tracing=_tracing(rx.url)) as gw:
                ids = []
                for _ in range(2):
                    r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
                    assert r.status == 200
                    ids.append(r.headers["traceparent"].split("-")[1])
    routes = [_tree(rx.spans, t)[1]["route"][0]["attrs"] for t in ids]
    blocks = routes[0]["velocity.route.prompt_blocks"]
    assert blocks > 4 and routes[1]["velocity.route.prompt_blocks"] == blocks
    assert routes[0]["velocity.route.prefix_blocks_matched"] == 0
    assert routes[1]["velocity.route.prefix_blocks_matched"] == blocks


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_responses_and_messages_are_traced(stream):
    """The other generation routes through admission, on the sim engine: /generate (a
    completion to the engine), the Responses API and the Messages API (chat); each its
    server span with the max tokens asked and the usage the engine reported, whole or
    streamed."""
    asks = {
        "/generate": ("text_completion", {"prompt": "once upon a time", "max_tokens": 4}),
        "/v1/responses": ("chat", {"input": "once upon a time", "max_output_tokens": 4}),
        "/v1/messages": ("chat", {"messages": [{"role": "user", "content": "once"}], "max_tokens": 4}),
    }
    with Receiver() as rx, sim_engine(model="sim-model") as eng:
        async with running_gateway(eng, tracing=_tracing(rx.url)) as gw:
            traces = {}
            for path, (_, body) in asks.items():
                body = {"model": "sim-model", **body, "stream": stream}
                s = await open_request(gw.port, "POST", path, body)
                try:
                    assert s.status == 200, await s.body()
                    await s.body()
                finally:
                    await s.close()
                traces[path] = s.headers["traceparent"].split("-")[1]
    for path, (op, _) in asks.items():
        server, children = _tree(rx.spans, traces[path])
        a = server["attrs"]
        assert server["name"] == f"{op} sim-model" and a["url.path"] == path, path
        assert a["gen_ai.request.max_tokens"] == 4, path
        assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.usage.input_tokens"] > 0, (path, a)
        assert sorted(children) == sorted(["admission.wait", f"{op} sim-model", "route"]), path
    # the Messages API's stop reason, not a stop string
    assert _tree(rx.spans, traces["/v1/messages"])[0]["attrs"]["gen_ai.response.finish_reasons"] == ["max_tokens"]


PREFILL_REPLY = (
    b'{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":700,"total_tokens":701,'
    b'"completion_tokens":1},"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[3],'
    b'"remote_engine_id":"p","remote_host":"127.0.0.1","remote_port":5600}}'
)
LONG = "the quick brown fox jumps over the lazy dog " * 60  # past the P/D decider's 256 tokens


async def test_each_pd_leg_is_a_client_span_and_each_engine_its_childs_parent():
    """With P/D roles, a long prompt takes two legs: beneath the server span, one route span
    (the decode engine, picked first), a client span for each prefill leg (the first, to an
    engine gone, failed; the retry on the other answered) and one for the decode leg after
    them; each engine got a traceparent naming its own leg's span."""
    from velocity_fast.config import EndpointConfig

    body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 7}
    health = {"check_interval_ms": 60000.0, "scrape_interval_ms": 60000.0}
    with Receiver() as rx:
        async with RecordingUpstream(reply=PREFILL_REPLY) as pre, RecordingUpstream(reply=REPLY) as dec:
            gone = await RecordingUpstream(reply=PREFILL_REPLY).__aenter__()
            eps = [
                EndpointConfig(name="p0", url=gone.url, model="m", role="prefill"),  # equal picks: the first
                EndpointConfig(name="p1", url=pre.url, model="m", role="prefill"),
                EndpointConfig(name="d", url=dec.url, model="m", role="decode"),
            ]
            async with running_gateway(
                settings=gateway_settings(endpoints=eps, health=health, tracing=_tracing(rx.url))
            ) as gw:
                await gone.__aexit__(None, None, None)  # gone: the first leg fails, unseen by checks
                r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
                assert r.status == 200, r.body
                assert (await http_request(gw.admin_port, "GET", "/stats")).json()["pd"]["m"]["prefill_retries"] == 1
    _, trace_id, _, flags = r.headers["traceparent"].split("-")
    server, children = _tree(rx.spans, trace_id)
    assert server["attrs"]["http.response.status_code"] == 200 and not server["error"]
    assert r.json()["usage"]["prompt_tokens"] == 700, r.json()
    assert server["attrs"]["gen_ai.usage.input_tokens"] == 700  # as the prefill engine counted the prompt
    assert sorted(children) == ["admission.wait", "chat m", "route"]
    ((route),) = children["route"]
    assert route["attrs"]["velocity.endpoint"] == "d"
    legs = sorted(children["chat m"], key=lambda s: s["start"])
    assert [(s["kind"], s["attrs"]["velocity.pd.leg"], s["attrs"]["velocity.endpoint"], s["error"]) for s in legs] == [
        (CLIENT, "prefill", "p0", True),
        (CLIENT, "prefill", "p1", False),
        (CLIENT, "decode", "d", False),
    ]
    assert legs[0]["end"] <= legs[1]["start"] and legs[1]["end"] <= legs[2]["start"]
    assert (
        legs[1]["attrs"]["http.response.status_code"] == 200 and legs[1]["attrs"]["velocity.pd.uncached_tokens"] > 256
    )
    assert legs[2]["attrs"]["http.response.status_code"] == 200
    for s in legs:
        assert server["start"] <= s["start"] <= s["end"] <= server["end"], s
    for up, span in ((pre, legs[1]), (dec, legs[2])):
        (sent,) = [h["traceparent"] for _, path, h, _ in up.requests if path == "/v1/chat/completions"]
        assert sent == f"00-{trace_id}-{span['span_id']}-{flags}"
