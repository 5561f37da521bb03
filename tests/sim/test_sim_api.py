"""The sim engine's HTTP surface, on real sockets, against what vLLM answers."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.sim import http_request, open_request, sim_engine

MODEL = "sim-api-model"
KEY = "sekrit"


@pytest.fixture(scope="module")
def eng():
    with sim_engine("--api-key", KEY, "--max-model-len", "512", model=MODEL, time_scale=50) as e:
        yield e


AUTH = {"authorization": f"Bearer {KEY}"}


async def post(eng, path, body, headers=None):
    return await http_request(eng.port, "POST", path, body, {**AUTH, **(headers or {})})


async def stream_events(eng, path, body, headers=None) -> tuple[int, dict, list[str]]:
    s = await open_request(eng.port, "POST", path, body, {**AUTH, **(headers or {})})
    try:
        events = [e async for e in s.events()]
    finally:
        await s.close()
    return s.status, s.headers, events


async def test_chat_stream_chunk_shapes(eng):
    status, headers, events = await stream_events(
        eng,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"x-request-id": "abc123"},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == "chatcmpl-abc123" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["model"] == MODEL and isinstance(c["created"], int) for c in chunks)
    role = chunks[0]["choices"][0]
    assert role["delta"] == {"role": "assistant", "content": ""} and role["finish_reason"] is None
    tokens = chunks[1:-1]
    assert len(tokens) == 4
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["delta"]["content"] for c in tokens)
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4


async def test_stream_without_include_usage_has_no_usage_chunk(eng):
    _, _, events = await stream_events(
        eng, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    )
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert len(chunks) == 3 and all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_completions_stream_with_continuous_usage(eng):
    _, _, events = await stream_events(
        eng,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    # no role chunk for completions; a text chunk per token, then the usage chunk
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert all("text" in c["choices"][0] for c in chunks[:3])
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == []


async def test_non_streaming_chat_has_usage_and_message(eng):
    r = await post(
        eng,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 6,
        },
    )
    assert r.status == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["system_fingerprint"].startswith("vllm-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 6 and u["total_tokens"] == u["prompt_tokens"] + 6


async def test_non_streaming_completion_without_max_tokens_stops_by_itself(eng):
    r = await post(eng, "/v1/completions", {"prompt": "Tell me a story", "ignore_eos": False})
    body = r.json()
    assert r.status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1


async def test_ignore_eos_generates_up_to_the_context_window(eng):
    r = await post(eng, "/v1/completions", {"prompt": "abcd" * 10, "ignore_eos": True})
    u = r.json()["usage"]
    assert u["total_tokens"] == 512  # --max-model-len


async def test_unknown_model_is_404_with_param_model(eng):
    r = await post(eng, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status == 404
    err = r.json()["error"]
    assert err == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_empty_model_means_the_default_one(eng):
    r = await post(eng, "/v1/completions", {"model": "", "prompt": "x", "max_tokens": 1})
    assert r.status == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize(
    "body, needle",
    [
        (b'{"messages": [', "truncated"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens"),
        (b'{"messages": []}', "messages"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}',
            "Stream options can only be defined when `stream=True`.",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "priority": "x"}', "priority"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}',
            "cannot be greater than max_model_len",
        ),
        (b'{"messages": [{"role": "user", "content": "' + b"y" * 3000 + b'"}]}', "maximum context length"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "at least 1"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}', "temperature must be non-negative"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop"),
    ],
)
async def test_bad_requests_are_400_in_vllm_shape(eng, body, needle):
    r = await post(eng, "/v1/chat/completions", body)
    assert r.status == 400
    err = r.json()["error"]
    # vLLM's types: "Bad Request" when the body is not the request model (FastAPI's
    # validation, the field as body.NAME), BadRequestError for its own checks.
    schema = needle in ("truncated", "messages") or err["message"].startswith("Expected")
    assert err["code"] == 400 and err["type"] == ("Bad Request" if schema else "BadRequestError"), err
    assert needle in err["message"] or needle in (err["param"] or "")
    # and the engine keeps serving
    ok = await post(eng, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert ok.status == 200


async def test_any_integer_priority_is_taken_as_vllm_takes_it(eng):
    # vLLM 0.32 takes a priority under either scheduling policy (fcfs ignores it), in the
    # body or its X-Vllm-Priority header; an unparsable header is ignored.
    for body, headers in (
        ({"priority": 1}, {}),
        ({"priority": -3}, {}),
        ({}, {"x-vllm-priority": "7"}),
        ({}, {"x-vllm-priority": "abc"}),
    ):
        r = await post(
            eng,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **body},
            headers=headers,
        )
        assert r.status == 200, (body, headers, r.body)


async def test_auth_only_on_v1_paths(eng):
    r = await http_request(eng.port, "GET", "/v1/models")
    assert r.status == 401 and r.json() == {"error": "Unauthorized"}
    r = await http_request(eng.port, "GET", "/v1/models", headers={"authorization": "Bearer wrong"})
    assert r.status == 401
    for path in ("/health", "/metrics", "/version", "/ping"):
        assert (await http_request(eng.port, "GET", path)).status == 200, path


async def test_models_list_shape(eng):
    r = await http_request(eng.port, "GET", "/v1/models", headers=AUTH)
    body = r.json()
    assert body["object"] == "list"
    (m,) = body["data"]
    assert m["id"] == MODEL and m["object"] == "model" and m["owned_by"] == "vllm"
    assert m["max_model_len"] == 512 and m["root"] == MODEL


async def test_health_version_tokenize_and_unknown_path(eng):
    h = await http_request(eng.port, "GET", "/health")
    assert h.status == 200 and h.body == b""
    assert (await http_request(eng.port, "POST", "/ping")).status == 200
    assert (await http_request(eng.port, "GET", "/version")).json() == {"version": "0.33.0"}
    t = await http_request(eng.port, "POST", "/tokenize", {"prompt": "a" * 40})
    assert t.json()["count"] == 10 and len(t.json()["tokens"]) == 10
    assert (await http_request(eng.port, "GET", "/nope")).status == 404


async def test_metrics_parse_with_vllm_names_and_labels(eng):
    await post(eng, "/v1/completions", {"prompt": "warm up", "max_tokens": 2})
    r = await http_request(eng.port, "GET", "/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    gauges = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ]
    counters = [
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:num_preemptions",
        "vllm:request_success",
    ]
    hists = [
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ]
    for name in gauges:
        assert fams[name].type == "gauge", name
    for name in counters:
        assert fams[name].type == "counter", name
    for name in hists:
        assert fams[name].type == "histogram", name
    for name in gauges[:3] + counters + hists:
        for s in fams[name].samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", (name, s)
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "2048"
    gen = [s.value for s in fams["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert gen and gen[0] >= 2
    ttft_count = [s.value for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0] >= 1


STORY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "A story, please"}],
    "max_tokens": 24,
    "temperature": 0.7,
}


async def test_sampling_fields_are_taken_and_a_stop_string_that_never_comes_changes_nothing(eng):
    """temperature and stop are accepted as vLLM takes them; a stop string the reply never
    holds (a client's turn marker) leaves it as it was."""
    plain = (await post(eng, "/v1/chat/completions", STORY)).json()
    marked = (await post(eng, "/v1/chat/completions", {**STORY, "stop": ["\n\nUser:", "###"]})).json()
    assert marked["choices"][0] == plain["choices"][0]
    assert marked["choices"][0]["finish_reason"] == "length" and marked["choices"][0]["stop_reason"] is None
    assert marked["usage"] == plain["usage"]


async def test_a_stop_string_ends_the_reply_before_it_as_vllm_does(eng):
    """A stop string met in the reply: the text ends before it, finish_reason "stop",
    stop_reason the string, the tokens counted up to the one that completed it; streamed
    the same. The sim's replies are seeded by the prompt, so the stop is a word of the
    reply the same request got without one."""
    plain = (await post(eng, "/v1/chat/completions", STORY)).json()
    text = plain["choices"][0]["message"]["content"]
    words = text.split(" ")
    stop = " " + words[len(words) // 2]  # a word in the middle (words start with a space)
    want = text[: text.index(stop)]
    r = (await post(eng, "/v1/chat/completions", {**STORY, "stop": ["never-there", stop]})).json()
    choice = r["choices"][0]
    assert choice["message"]["content"] == want and stop not in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert 1 <= r["usage"]["completion_tokens"] < plain["usage"]["completion_tokens"]
    status, _, events = await stream_events(
        eng, "/v1/chat/completions", {**STORY, "stop": stop, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = [json.loads(e) for e in events[:-1]]
    assert status == 200 and events[-1] == "[DONE]"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert streamed == want
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    assert chunks[-1]["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]
    done = (await post(eng, "/v1/completions", {"prompt": "A story, please", "max_tokens": 24})).json()
    ctext = done["choices"][0]["text"]
    cstop = " " + ctext.split(" ")[2]
    c = (await post(eng, "/v1/completions", {"prompt": "A story, please", "max_tokens": 24, "stop": cstop})).json()
    assert c["choices"][0]["text"] == ctext[: ctext.index(cstop)]
    assert c["choices"][0]["finish_reason"] == "stop" and c["choices"][0]["stop_reason"] == cstop
