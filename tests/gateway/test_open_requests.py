"""A request that names no max tokens runs until the model stops. The gateway takes it for
what the pool's engines returned for such requests (their usage's completion tokens,
learned per model and per route), in admission and in a tenant's token quota alike."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import http_request, open_request, sim_engine
from velocity_fast.admission.estimators import OPEN_START_CHAT, OPEN_START_TEXT

MODEL = "m1"


@pytest.fixture(scope="module")
def engine():
    # Replies that end by themselves, 24 tokens on average (their length is drawn from the
    # prompt: the same prompt, the same length).
    with sim_engine("--natural-output-mean", "24", model=MODEL) as eng:
        yield eng


def _chat(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


async def _completion_tokens(port: int, path: str, body: dict) -> int:
    r = await http_request(port, "POST", path, body, timeout=30)
    assert r.status == 200, r.body
    return r.json()["usage"]["completion_tokens"]


def _open_tokens(gw) -> dict:
    return gw.admission.stats()["pools"][MODEL]["open_tokens"]


@pytest.mark.timeout(60)
async def test_the_estimate_is_what_such_requests_returned_per_route(engine):
    async with running_gateway(engine) as gw:
        assert _open_tokens(gw)["chat"] == {"tokens": OPEN_START_CHAT, "answers": 0, "start": OPEN_START_CHAT}
        got = [await _completion_tokens(gw.port, "/v1/chat/completions", _chat(f"question {i}")) for i in range(3)]
        # A stream that asked for no usage: the gateway asks the engine for it, and learns
        # from it, but the client's stream comes without it.
        body = _chat("a streamed question", stream=True)
        s = await open_request(gw.port, "POST", "/v1/chat/completions", body, timeout=30)
        events = [e async for e in s.events()]
        await s.close()
        assert events[-1] == "[DONE]" and not any('"usage"' in e for e in events)
        got.append(await _completion_tokens(engine.port, "/v1/chat/completions", dict(body, stream=False)))
        await wait_until(lambda: _open_tokens(gw)["chat"]["answers"] == 4, 5.0, what="the stream learned")
        assert _open_tokens(gw)["chat"]["tokens"] == math.ceil(sum(got) / len(got)), got
        # /v1/completions has its own (vLLM stops it at 16 tokens by default); a request
        # that names its max tokens teaches neither.
        assert _open_tokens(gw)["completions"]["answers"] == 0
        text = await _completion_tokens(gw.port, "/v1/completions", {"model": MODEL, "prompt": "once upon a time"})
        await _completion_tokens(gw.port, "/v1/chat/completions", _chat("bounded", max_tokens=3))
        await _completion_tokens(gw.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert _open_tokens(gw)["completions"] == {"tokens": text, "answers": 1, "start": OPEN_START_TEXT}
        assert _open_tokens(gw)["chat"]["answers"] == 4


@pytest.mark.timeout(60)
async def test_a_token_quota_draws_the_learned_estimate(engine):
    """The quota's draw at arrival is the prompt's estimate plus the learned reply, not a
    fixed guess: a tenant that sends no max tokens is not charged for replies it never gets."""
    tenants = [{"name": "q", "api_key": "k-q", "tokens_per_minute": 600}]  # 10 tokens/s refill
    async with running_gateway(engine, tenants=tenants) as gw:
        h = {"authorization": "Bearer k-q", "x-velocity-sla-ms": "600000"}
        for i in range(3):
            r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(f"question {i}"), h, timeout=30)
            assert r.status == 200, r.body
        learned = _open_tokens(gw)["chat"]["tokens"]
        assert learned < 60
        t = gw.identity.tenants["q"]
        before = t.tokens_left()
        body = _chat("the question whose draw is read", stream=True)
        s = await open_request(gw.port, "POST", "/v1/chat/completions", body, h, timeout=30)
        try:
            assert s.status == 200
            drawn = before - t.tokens_left()  # while it streams: drawn, not yet settled
        finally:
            await s.close()
        assert drawn == pytest.approx(len(json.dumps(body).encode()) / 4 + learned, abs=3.0)
