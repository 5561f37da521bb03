"""vLLM 0.32's routes beyond chat and completions, through the gateway, against real vLLM
CPU engines: the Responses and Messages APIs go through admission and settle a tenant
from their own usage shapes (whole and streamed); /tokenize, /detokenize and /version are
vLLM's own answers relayed; GET /v1/models/{id} is the gateway's (vLLM has no such route);
/v1/embeddings on a generation model is vLLM's own 404."""

from __future__ import annotations

import json

import pytest

from tests.support.gateway import wait_until
from tests.support.sim import http_request, sse_events
from tests.vllm.support.gateway import vllm_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

TENANT = [{"name": "t", "api_key": "k-t", "tokens_per_minute": 10_000_000}]
AUTH = {"authorization": "Bearer k-t", "x-velocity-sla-ms": "600000"}


def gateway(pair, **keys):
    return vllm_gateway(pair.engines, **keys)


async def test_responses_and_messages_settle_the_tenant_from_vllms_usage(chatml):
    model = chatml.model
    async with gateway(chatml, tenants=TENANT) as gw:
        t = gw.identity.tenants["t"]
        r = await http_request(
            gw.port,
            "POST",
            "/v1/responses",
            {"model": model, "input": "hello there", "max_output_tokens": 7},
            AUTH,
            timeout=60,
        )
        assert r.status == 200, r.body
        got = r.json()
        assert got["object"] == "response" and got["usage"]["output_tokens"] == 7
        assert r.headers.get("x-velocity-endpoint")  # admitted and routed by the gateway
        await wait_until(lambda: t.served_completion == 7, 10.0, what="the answer settled")
        assert t.served_prompt == got["usage"]["input_tokens"] > 0

        evs = await sse_events(
            gw.port,
            "/v1/responses",
            {"model": model, "input": "hello again", "max_output_tokens": 5, "stream": True},
            AUTH,
            timeout=60,
        )
        done = [d for k, d in evs if k == "response.completed"]
        assert done and done[0]["response"]["usage"]["output_tokens"] == 5
        await wait_until(lambda: t.served_completion == 12, 10.0, what="the Responses stream settled")

        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
        r = await http_request(gw.port, "POST", "/v1/messages", body, AUTH, timeout=60)
        assert r.status == 200, r.body
        assert r.json()["type"] == "message" and r.json()["usage"]["output_tokens"] == 6
        await wait_until(lambda: t.served_completion == 18, 10.0, what="the Messages answer settled")

        evs = await sse_events(gw.port, "/v1/messages", {**body, "max_tokens": 3, "stream": True}, AUTH, timeout=60)
        assert evs[0][0] == "message_start" and evs[-1][0] == "message_stop"
        await wait_until(lambda: t.served_completion == 21, 10.0, what="the Messages stream settled")


async def test_relayed_routes_are_vllms_own_answers(chatml):
    model, eng = chatml.model, chatml.engines[0]
    async with gateway(chatml) as gw:
        for path, body in (
            ("/tokenize", {"model": model, "prompt": "hello world"}),
            ("/detokenize", {"model": model, "tokens": [5, 6, 7]}),
        ):
            via = await http_request(gw.port, "POST", path, body)
            direct = await http_request(int(eng.url.rsplit(":", 1)[1]), "POST", path, body)
            assert via.status == direct.status == 200, (path, via.body)
            assert via.json() == direct.json()
        v = await http_request(gw.port, "GET", "/version")
        assert v.status == 200 and v.json() == json.loads(eng.get("/version")[1])
        m = await http_request(gw.port, "GET", f"/v1/models/{model}")
        assert m.status == 200 and m.json()["id"] == model and m.json()["max_model_len"] > 0
        assert eng.get(f"/v1/models/{model}")[0] == 404  # vLLM has no such route: the gateway answers it
        e = await http_request(gw.port, "POST", "/v1/embeddings", {"model": model, "input": "x"})
        assert e.status == 404  # a generation model: vLLM registers no embeddings route
