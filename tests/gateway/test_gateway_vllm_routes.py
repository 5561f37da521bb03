"""vLLM's routes beyond chat and completions, through a running gateway and a sim engine
(real sockets): the Responses and Messages APIs through admission (band, tenant, quota,
their own usage shapes settled), /v1/embeddings, /tokenize, /detokenize and /version
relayed to an engine, GET /v1/models/{id} from the gateway's model list, the openai
client's models.retrieve, embeddings.create and responses.create, and the error paths."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import http_request, open_request, sse_events, start_sim_engine

MODEL = "sim-model"
LONG_SLA = {"x-velocity-sla-ms": "600000"}
TENANT = [{"name": "t", "api_key": "k-t", "tokens_per_minute": 10_000_000}]
AUTH = {"authorization": "Bearer k-t", **LONG_SLA}


@pytest.fixture(scope="module")
def engine():
    eng = start_sim_engine(model=MODEL, time_scale=50)
    yield eng
    eng.stop()


def client(gw, key: str = "none") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0, timeout=10.0)


def _error(r) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]


# -- the openai client -----------------------------------------------------------------------


async def test_openai_client_models_retrieve_embeddings_and_responses(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        m = await c.models.retrieve(MODEL)
        assert (m.id, m.object) == (MODEL, "model")
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("no-such-model")

        e = await c.embeddings.create(model=MODEL, input=["hello", "world"])
        assert len(e.data) == 2 and e.data[0].embedding and e.data[0].embedding != e.data[1].embedding
        again = await c.embeddings.create(model=MODEL, input="hello")
        assert again.data[0].embedding == e.data[0].embedding  # the engine's own, relayed as it is
        with pytest.raises(openai.NotFoundError):
            await c.embeddings.create(model="no-such-model", input="x")

        r = await c.responses.create(model=MODEL, input="Say hi", max_output_tokens=5)
        # Cut by max_output_tokens: "incomplete", as vLLM 0.32 answers.
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.output_text
        assert r.usage.output_tokens == 5 and r.usage.input_tokens > 0

        stream = await c.responses.create(model=MODEL, input="Say hi", max_output_tokens=4, stream=True)
        kinds = [ev.type async for ev in stream]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 4


# -- generation routes go through admission, their usage read from their own shapes ----------


@pytest.mark.timeout(60)
async def test_responses_whole_and_streamed_settle_the_tenant_from_their_usage(engine):
    async with running_gateway(engine, tenants=TENANT) as gw:
        t = gw.identity.tenants["t"]
        r = await http_request(
            gw.port, "POST", "/v1/responses", {"model": MODEL, "input": "hello there", "max_output_tokens": 7}, AUTH
        )
        assert r.status == 200, r.body
        assert r.json()["usage"]["output_tokens"] == 7
        assert r.headers.get("x-velocity-endpoint")  # routed to an engine by the gateway
        await wait_until(lambda: t.served_completion == 7, 5.0, what="the answer settled")
        assert t.served_prompt == r.json()["usage"]["input_tokens"]

        evs = await sse_events(
            gw.port,
            "/v1/responses",
            {"model": MODEL, "input": "hello again", "max_output_tokens": 5, "stream": True},
            AUTH,
        )
        done = [d for k, d in evs if k == "response.completed"]
        assert done and done[0]["response"]["usage"]["output_tokens"] == 5
        await wait_until(lambda: t.served_completion == 12, 5.0, what="the stream settled")


@pytest.mark.timeout(60)
async def test_messages_whole_and_streamed_settle_the_tenant_from_their_usage(engine):
    async with running_gateway(engine, tenants=TENANT) as gw:
        t = gw.identity.tenants["t"]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "system": "be brief",
            "priority": "high",
        }
        r = await http_request(gw.port, "POST", "/v1/messages", body, AUTH)
        assert r.status == 200, r.body
        got = r.json()
        assert got["type"] == "message" and got["usage"]["output_tokens"] == 6
        assert r.headers.get("x-velocity-band") == "high"  # the band admission placed it in
        await wait_until(lambda: t.served_completion == 6, 5.0, what="the answer settled")
        assert t.served_prompt == got["usage"]["input_tokens"]

        evs = await sse_events(gw.port, "/v1/messages", {**body, "max_tokens": 3, "stream": True}, AUTH)
        assert [k for k, _ in evs][0] == "message_start" and evs[-1][0] == "message_stop"
        await wait_until(lambda: t.served_completion == 9, 5.0, what="the stream settled")
        assert gw.metrics.requests.by_values[("/v1/messages", 200, "high")].value == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/responses", {"model": MODEL, "input": "hello"}),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}),
    ],
)
async def test_generation_routes_count_against_the_token_quota(engine, path, body):
    field = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    tenants = [{"name": "g", "api_key": "k-g", "tokens_per_minute": 300}]
    async with running_gateway(engine, tenants=tenants) as gw:
        h = {"authorization": "Bearer k-g", **LONG_SLA}
        r = await http_request(gw.port, "POST", path, {**body, field: 100}, h, timeout=30)
        assert r.status == 200, r.body
        t = gw.identity.tenants["g"]
        await wait_until(lambda: t.served_completion == 100, 5.0, what="the answer settled")
        r = await http_request(gw.port, "POST", path, {**body, field: 250}, h, timeout=30)
        assert r.status == 429 and r.headers["x-velocity-reject-reason"] == "rate-limit"
        assert "tokens per minute" in _error(r)["message"]
        assert t.rejections == {"rate-limit": 1}


# -- relayed routes --------------------------------------------------------------------------


async def test_tokenize_detokenize_and_version_are_the_engines(engine):
    async with running_gateway(engine) as gw:
        tok = await http_request(gw.port, "POST", "/tokenize", {"model": MODEL, "prompt": "hello world"})
        assert tok.status == 200
        assert (
            tok.json()
            == (await http_request(engine.port, "POST", "/tokenize", {"model": MODEL, "prompt": "hello world"})).json()
        )
        de = await http_request(gw.port, "POST", "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]})
        assert de.status == 200 and de.json()["prompt"]
        assert (
            de.json()
            == (await http_request(engine.port, "POST", "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]})).json()
        )
        v = await http_request(gw.port, "GET", "/version")
        assert v.status == 200 and v.json() == (await http_request(engine.port, "GET", "/version")).json()
        m = await http_request(gw.port, "GET", f"/v1/models/{MODEL}")
        assert m.status == 200 and m.json()["id"] == MODEL and m.json()["object"] == "model"


# -- error paths -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "model"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/responses", {"model": "nope", "input": "x"}, 404, "model"),
        (
            "/v1/messages",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
            404,
            "model",
        ),
        ("/v1/embeddings", b"{not json", 400, None),
        ("/v1/responses", {"model": MODEL}, 400, "input"),  # required
        ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
        ("/v1/messages", {"model": MODEL, "messages": [], "max_tokens": 4}, 400, "messages"),
        (
            "/v1/messages",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            400,
            "max_tokens",
        ),  # past the context
    ],
)
async def test_bad_requests_get_openai_error_shapes(engine, path, body, status, param):
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", path, body)
        assert r.status == status, r.body
        err = _error(r)
        assert err["message"] and err["param"] == param


async def test_unknown_route_404_lists_the_routes_and_wrong_method_is_405(engine):
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "GET", "/v1/nothing")
        assert r.status == 404
        msg = _error(r)["message"]
        for route in (
            "POST /v1/chat/completions",
            "POST /v1/responses",
            "POST /v1/messages",
            "POST /v1/embeddings",
            "POST /tokenize",
            "POST /detokenize",
            "GET /version",
            "GET /v1/models/{id}",
        ):
            assert route in msg
        r = await http_request(gw.port, "GET", "/v1/embeddings")
        assert r.status == 405


def test_body_usage_reads_the_responses_and_messages_shapes():
    from velocity_fast.gateway.usage import body_usage

    responses = (
        b'{"id":"resp_1","object":"response","output":[],"status":"completed","usage":{"input_tokens":12,'
        b'"input_tokens_details":{"cached_tokens":4},"output_tokens":7,"output_tokens_details":'
        b'{"reasoning_tokens":0},"total_tokens":19},"user":null}'
    )
    assert body_usage(responses) == (12, 4, 7)
    messages = (
        b'{"id":"msg_1","type":"message","content":[{"type":"text","text":"usage"}],"stop_reason":"end_turn",'
        b'"usage":{"input_tokens":9,"output_tokens":3,"cache_read_input_tokens":null}}'
    )
    assert body_usage(messages) == (9, 0, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_generation_routes_are_routed_by_their_prompts_prefix(path):
    """Two engines, two long system prompts: the gateway reads the prompt of these routes
    (system first) and its picks follow the shared prefix, as chat's do."""
    engines = [start_sim_engine(model=MODEL, time_scale=50) for _ in range(2)]
    try:
        async with running_gateway(*engines) as gw:
            for i in range(8):
                system = f"You are assistant {i % 2}. " + "Answer with care and cite sources. " * 60
                if path == "/v1/messages":
                    body = {
                        "model": MODEL,
                        "system": system,
                        "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"question {i}"}],
                    }
                else:
                    body = {
                        "model": MODEL,
                        "instructions": system,
                        "max_output_tokens": 2,
                        "input": [{"role": "user", "content": f"question {i}"}],
                    }
                r = await http_request(gw.port, "POST", path, body)
                assert r.status == 200, r.body
            picks = gw.stats()["routing"]["picks"]
            assert sum(p.get("prefix", 0) for p in picks.values()) >= 4, picks
    finally:
        for e in engines:
            e.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_a_client_that_leaves_a_generation_stream_frees_the_engine(path):
    with_tokens = {"max_tokens": 3000} if path == "/v1/messages" else {"max_output_tokens": 3000}
    body = {
        "model": MODEL,
        "stream": True,
        **with_tokens,
        **({"messages": [{"role": "user", "content": "go on"}]} if path == "/v1/messages" else {"input": "go on"}),
    }
    eng = start_sim_engine(model=MODEL, time_scale=1)
    try:
        async with running_gateway(eng) as gw:
            s = await open_request(gw.port, "POST", path, body, LONG_SLA, timeout=30)
            try:
                assert s.status == 200
                seen = 0
                async for _ in s.events():
                    seen += 1
                    if seen >= 6:
                        break
                assert eng.metric("vllm:num_requests_running") == 1
                s.abort()
            finally:
                await s.close()
            await wait_until(
                lambda: eng.metric("vllm:num_requests_running") == 0, 5.0, what="the engine's request aborted"
            )
    finally:
        eng.stop()


@pytest.mark.timeout(60)
async def test_relayed_routes_without_a_healthy_engine_are_503():
    import socket

    with socket.socket() as sock:  # a port no engine listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with running_gateway(("e1", f"http://127.0.0.1:{port}", MODEL), healthy=0) as gw:
        for method, path, body in [
            ("POST", "/v1/embeddings", {"model": MODEL, "input": "x"}),
            ("POST", "/tokenize", {"model": MODEL, "prompt": "x"}),
            ("GET", "/version", None),
        ]:
            r = await http_request(gw.port, method, path, body)
            assert r.status == 503, (path, r.body)
            assert "No healthy engine" in _error(r)["message"]
        r = await http_request(gw.port, "GET", f"/v1/models/{MODEL}")  # listed only while it can answer
        assert r.status == 404
