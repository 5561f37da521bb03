"""The sim engine does what vLLM does with the common sampling fields, or refuses as vLLM
does: n choices, logprobs in vLLM's shapes, vLLM's 400s for bad values and for features
the sim does not implement, and a client that leaves is no error."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.sim import http_request, open_request, sim_engine

MODEL = "sim-fidelity"
MSGS = [{"role": "user", "content": "Tell me something"}]


@pytest.fixture(scope="module")
def eng():
    with sim_engine("--max-model-len", "512", model=MODEL, time_scale=50) as e:
        yield e


async def post(eng, path, body):
    return await http_request(eng.port, "POST", path, body)


async def stream_chunks(eng, path, body) -> list[dict]:
    s = await open_request(eng.port, "POST", path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    try:
        events = [e async for e in s.events()]
    finally:
        await s.close()
    assert s.status == 200 and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- n ---------------------------------------------------------------------------------
async def test_n_gives_n_choices_indexed_and_counted(eng):
    one = (await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 5})).json()
    r = await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 5, "n": 3})
    assert r.status == 200
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(set(texts)) == 3, "n samples, not one reply three times"
    assert texts[0] == one["choices"][0]["message"]["content"]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 15
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 15
    c = (await post(eng, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "n": 2})).json()
    assert [ch["index"] for ch in c["choices"]] == [0, 1] and c["choices"][0]["text"] != c["choices"][1]["text"]
    assert c["usage"]["completion_tokens"] == 8


async def test_n_streams_chunks_per_choice_index(eng):
    whole = (await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "n": 2})).json()
    chunks = await stream_chunks(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "n": 2})
    roles = [c["choices"][0] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [r["index"] for r in roles] == [0, 1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        text = "".join(ch["delta"].get("content") or "" for ch in mine)
        assert text == whole["choices"][i]["message"]["content"]
        assert [ch["finish_reason"] for ch in mine][-1] == "length"
        assert sum(1 for ch in mine if ch["finish_reason"]) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(len(c["choices"]) <= 1 for c in chunks)
    comp = await stream_chunks(eng, "/v1/completions", {"prompt": "Once", "max_tokens": 3, "n": 2})
    assert sorted(c["choices"][0]["index"] for c in comp if c["choices"]) == [0, 0, 0, 1, 1, 1]
    assert comp[-1]["usage"]["completion_tokens"] == 6


# -- logprobs ----------------------------------------------------------------------------
def _check_chat_entries(entries, k):
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
        top = e["top_logprobs"]
        assert len(top) == k
        if k:
            assert top[0]["token"] == e["token"] and top[0]["logprob"] == e["logprob"]
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert len({t["token"] for t in top}) == k


async def test_chat_logprobs_in_vllms_shape_whole_and_streamed(eng):
    body = {"messages": MSGS, "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
    r = (await post(eng, "/v1/chat/completions", body)).json()
    choice = r["choices"][0]
    entries = choice["logprobs"]["content"]
    assert len(entries) == 6 and "".join(e["token"] for e in entries) == choice["message"]["content"]
    _check_chat_entries(entries, 3)
    plain = (await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 6, "logprobs": True})).json()
    _check_chat_entries(plain["choices"][0]["logprobs"]["content"], 0)
    assert (await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})).json()["choices"][0][
        "logprobs"
    ] is None
    chunks = await stream_chunks(eng, "/v1/chat/completions", body)
    streamed = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == entries


async def test_completion_logprobs_in_vllms_shape_whole_and_streamed(eng):
    body = {"prompt": "Once upon", "max_tokens": 5, "logprobs": 2}
    r = (await post(eng, "/v1/completions", body)).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 5
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(5)]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and top[tok] == val and max(top.values()) == val <= 0
    chunks = await stream_chunks(eng, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]
    assert [t for p in parts for t in p["top_logprobs"]] == lp["top_logprobs"]


# -- refusals ----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "extra, message, param",
    [
        ({"temperature": "hot"}, "Expected `float | null`, got `str` - at `$.temperature`", "body.temperature"),
        (
            {"temperature": 2.5},
            "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
            "temperature",
        ),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
        ({"top_p": "all"}, "Expected `float | null`, got `str` - at `$.top_p`", "body.top_p"),
        (
            {"max_completion_tokens": 0},
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "max_tokens",
        ),
        ({"max_tokens": 1.5}, "Expected `int | null`, got `float` - at `$.max_tokens`", "body.max_tokens"),
        ({"n": 0}, "n must be at least 1, got 0.", None),
        ({"n": "2"}, "Expected `int | null`, got `str` - at `$.n`", "body.n"),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2.", None),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5.", None),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0.", None),
        ({"seed": 2**63}, "Expected `int` <= 9223372036854775807 - at `$.seed`", "body.seed"),
        ({"seed": "x"}, "Expected `int | null`, got `str` - at `$.seed`", "body.seed"),
        ({"stop": ["end", ""]}, "stop cannot contain an empty string.", None),
        ({"logprobs": "yes"}, "Expected `bool | null`, got `str` - at `$.logprobs`", "body.logprobs"),
        ({"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"),
        (
            {"logprobs": True, "top_logprobs": -2},
            "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-2)",
            "top_logprobs",
        ),
        (
            {"logprobs": True, "top_logprobs": 21},
            "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
            "logprobs",
        ),
        (
            {"stream_options": {"include_usage": True}},
            "Stream options can only be defined when `stream=True`.",
            "stream_options",
        ),
        (
            {"tools": []},
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        ),
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        (
            {"tools": TOOLS},
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required"},
            'tool_choice "required" is not supported by the sim engine: it does not generate tool calls.',
            "tool_choice",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice a named function is not supported by the sim engine: it does not generate tool calls.",
            "tool_choice",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format type 'json_schema' is not supported by the sim engine: it does not implement structured "
            "outputs.",
            "response_format",
        ),
        (
            {"response_format": {"type": "json_object"}},
            "response_format type 'json_object' is not supported by the sim engine: it does not implement structured "
            "outputs.",
            "response_format",
        ),
    ],
)
async def test_chat_refusals_are_vllms_400(eng, extra, message, param):
    r = await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **extra})
    assert r.status == 400, r.body
    assert r.json() == {"error": {"message": message, "type": _type(param), "param": param, "code": 400}}


@pytest.mark.parametrize(
    "extra, message, param",
    [
        ({"logprobs": True}, "Expected `int | null`, got `bool` - at `$.logprobs`", "body.logprobs"),
        ({"logprobs": -3}, "logprobs must be non-negative or -1, got -3. (parameter=logprobs, value=-3)", "logprobs"),
        (
            {"logprobs": 25},
            "Requested sample logprobs of 25, which is greater than max allowed: 20 (parameter=logprobs, value=25)",
            "logprobs",
        ),
        (
            {"temperature": -1},
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
            "temperature",
        ),
        (
            {"n": 16385},
            "n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable.",
            None,
        ),
    ],
)
async def test_completion_refusals_are_vllms_400(eng, extra, message, param):
    r = await post(eng, "/v1/completions", {"prompt": "x", "max_tokens": 2, **extra})
    assert r.status == 400, r.body
    assert r.json() == {"error": {"message": message, "type": _type(param), "param": param, "code": 400}}


def _type(param: str | None) -> str:
    """vLLM's error type: a body that is not the request model fails FastAPI's validation
    ("Bad Request", the field as body.NAME); its own checks raise BadRequestError."""
    return "Bad Request" if param and param.startswith("body.") else "BadRequestError"


async def test_what_vllm_takes_without_extra_features_is_served(eng):
    """tools with tool_choice "none", a text response_format and in-range sampling fields
    are what vLLM serves as plain generation: 200."""
    for extra in (
        {"tools": TOOLS, "tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"temperature": 0, "top_p": 1, "seed": -5, "presence_penalty": -2, "frequency_penalty": 2},
        {"temperature": 2.0, "n": 2, "logprobs": True, "top_logprobs": 20},
    ):
        r = await post(eng, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **extra})
        assert r.status == 200, (extra, r.body)


# -- disconnects -----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_is_no_error(stream):
    with sim_engine(model=MODEL, time_scale=1) as e:
        body = json.dumps({"messages": MSGS, "max_tokens": 500, "n": 2, "stream": stream}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", e.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if e.metric("vllm:num_requests_running") == 2:
                break
        assert e.metric("vllm:num_requests_running") == 2
        writer.close()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if e.metric("vllm:num_requests_running") == 0:
                break
        assert e.metric("vllm:num_requests_running") == 0, "both choices aborted"
        assert (await http_request(e.port, "GET", "/health")).status == 200
        assert "ERROR" not in e.stderr_text and "Traceback" not in e.stderr_text, e.stderr_text
