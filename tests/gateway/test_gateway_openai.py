"""The official `openai` client, pointed at the gateway with base_url, works unchanged:
answers, streams, usage chunks, the models list and its exception types (docs/design.md, "Arrival")."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from tests.support.gateway import running_gateway
from tests.support.sim import start_sim_engine

MODEL = "sim-model"


@pytest.fixture(scope="module")
def engine():
    eng = start_sim_engine(model=MODEL, time_scale=50)
    yield eng
    eng.stop()


def client(gw, key: str = "none", **kw) -> AsyncOpenAI:
    # No retries: a retried 429 or 5xx would hide the status under test.
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0, timeout=10.0, **kw)


async def test_chat_and_completions_non_streaming(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8
        )
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content
        assert chat.usage.completion_tokens == 8
        assert chat.usage.prompt_tokens > 0

        comp = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
        assert comp.object == "text_completion"
        assert comp.choices[0].text
        assert comp.usage.completion_tokens == 5


async def test_chat_streaming_with_usage_chunk(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content
    usage = [ch for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and not usage[0].choices, "one final usage chunk with no choices"
    assert usage[0].usage.completion_tokens == 6
    assert chunks[-1] is usage[0]


async def test_completions_streaming_without_usage(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        stream = await c.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True)
        chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_list(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "sim-model", "messages": [', None),  # malformed JSON
        (b'{"model": "sim-model"}', "messages"),  # missing messages
        (b'{"model": "sim-model", "messages": "hi"}', "messages"),  # wrong type
        (b'{"model": "sim-model", "messages": [{"role":"user","content":"x"}], "max_tokens": "ten"}', "max_tokens"),
        (
            (
                b'{"model": "sim-model", "messages": [{"role":"user","content":"x"}], '
                b'"stream_options": {"include_usage": true}}'
            ),
            "stream_options",
        ),  # stream_options without stream
    ],
)
async def test_bad_request_chat(engine, body, param):
    async with running_gateway(engine) as gw, client(gw) as c:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.post(
                "/chat/completions",
                content=body,
                cast_to=object,
                options={"headers": {"content-type": "application/json"}},
            )
    err = ei.value
    assert err.status_code == 400
    assert err.body["code"] == 400
    assert err.body["message"]
    if param is not None:
        assert err.body["param"] == param


async def test_bad_request_completions_missing_prompt(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        with pytest.raises(openai.BadRequestError) as ei:
            await c.post("/completions", body={"model": MODEL, "max_tokens": 3}, cast_to=object)
    assert ei.value.body["param"] == "prompt"


async def test_stream_options_without_stream_via_sdk(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                stream_options={"include_usage": True},
            )


async def test_authentication_global_key(engine):
    async with running_gateway(engine, api_key="secret") as gw:
        async with client(gw, "wrong") as c:
            with pytest.raises(openai.AuthenticationError) as ei:
                await c.models.list()
            assert ei.value.status_code == 401
        async with client(gw, "secret") as c:
            assert (await c.models.list()).data
        # X-API-Key is accepted too (the SDK also sends its Bearer: make that one empty-ish wrong)
        async with client(gw, "wrong", default_headers={"Authorization": "", "X-API-Key": "secret"}) as c:
            out = await c.completions.create(model=MODEL, prompt="k", max_tokens=2)
            assert out.choices[0].text


async def test_authentication_tenant_key(engine):
    tenants = [{"name": "alpha", "api_key": "key-alpha"}]
    async with running_gateway(engine, tenants=tenants) as gw:
        async with client(gw, "key-beta") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        async with client(gw, "key-alpha") as c:
            out = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert out.choices[0].message.content


async def test_not_found_model_and_path(engine):
    async with running_gateway(engine) as gw, client(gw) as c:
        with pytest.raises(openai.NotFoundError) as ei:
            await c.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert ei.value.body["param"] == "model"
        assert "no-such-model" in ei.value.body["message"]
        with pytest.raises(openai.NotFoundError):  # (a path no engine serves: /embeddings is relayed now)
            await c.post("/no-such-route", body={"model": MODEL, "input": "x"}, cast_to=object)


async def test_rate_limit_per_tenant(engine):
    tenants = [{"name": "slow", "api_key": "key-slow", "requests_per_second": 0.5, "burst": 1}]
    async with running_gateway(engine, tenants=tenants) as gw, client(gw, "key-slow") as c:
        first = await c.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert first.choices[0].text
        with pytest.raises(openai.RateLimitError) as ei:
            await c.completions.create(model=MODEL, prompt="b", max_tokens=2)
    r = ei.value.response
    assert r.status_code == 429
    assert r.headers["x-velocity-reject-reason"] == "rate-limit"
    assert 1 <= int(r.headers["retry-after"]) <= 2
