"""The OpenAI surface through the gateway, against real vLLM CPU engines (tiny random
model: the text is gibberish, everything the gateway reads is vLLM's own).

- chat and completions, streamed and not; a stream with ``include_usage`` equals vLLM's
  direct stream apart from ids and timestamps;
- ``n: 2``, ``logprobs``, a tools body: the gateway's answer is vLLM's;
- vLLM's 400 for ``max_tokens`` past the context; 404 for an unknown model;
- a client that leaves mid-stream: vLLM's ``num_requests_running`` drops within 1 s;
- ``/v1/models``, and ``max_model_len`` read from vLLM;
- admission's learned batch equals ``--max-num-seqs``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.support.gateway import wait_until
from tests.support.sim import http_request, open_request
from tests.vllm.support.engines import MAX_MODEL_LEN, MAX_NUM_SEQS
from tests.vllm.support.gateway import vllm_gateway

# The first test of the session waits for the engines to start (about 30-90 s each).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def gateway(pair, **keys):
    return vllm_gateway(pair.engines, **keys)


def chat(model: str, text: str = "how does the gateway route a request?", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def _skeleton(x):
    if isinstance(x, dict):
        return tuple(sorted((k, _skeleton(v)) for k, v in x.items() if k not in ("content", "usage")))
    if isinstance(x, list):
        return tuple(_skeleton(v) for v in x)
    return type(x).__name__ if x is not None else None


def normalized(events: list[str]) -> dict:
    """What a client reads from a chat stream, without what differs from call to call:
    ids, timestamps, and where vLLM cuts the text into chunks (its API server merges the
    deltas of steps it fell behind on, so the cuts move with the machine's load)."""
    chunks = [json.loads(ev) for ev in events if ev.startswith("{")]
    return {
        "done": events[-1] == "[DONE]" and events.count("[DONE]") == 1,
        "shapes": {_skeleton({k: v for k, v in c.items() if k not in ("id", "created")}) for c in chunks},
        "models": {c["model"] for c in chunks},
        "role": [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]][:1],
        "text": "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]),
        "finish": [
            c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
        ],
        "usage": [c["usage"] for c in chunks if c.get("usage")],
    }


async def _is(fn, value) -> bool:
    # Off the event loop: the gateway under test runs on it.
    return await asyncio.to_thread(fn) == value


async def stream_events(port: int, path: str, body: dict) -> tuple[int, list[str]]:
    s = await open_request(port, "POST", path, body, timeout=60)
    try:
        return s.status, [ev async for ev in s.events()]
    finally:
        await s.close()


async def test_chat_and_completions_streamed_and_not(chatml):
    model = chatml.model
    async with gateway(chatml) as gw:
        r = await http_request(gw.port, "POST", CHAT, chat(model), timeout=60)
        assert r.status == 200, r.body
        d = r.json()
        assert d["object"] == "chat.completion" and d["choices"][0]["message"]["role"] == "assistant"
        assert d["usage"]["completion_tokens"] == 8 and d["usage"]["prompt_tokens"] > 0

        r = await http_request(
            gw.port, "POST", COMPLETIONS, {"model": model, "prompt": "the gateway", "max_tokens": 8}, timeout=60
        )
        assert r.status == 200, r.body
        assert r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] == 8

        usage = {"stream_options": {"include_usage": True}}
        for path, body in (
            (CHAT, chat(model, stream=True, **usage)),
            (COMPLETIONS, {"model": model, "prompt": "the gateway", "max_tokens": 8, "stream": True, **usage}),
        ):
            status, events = await stream_events(gw.port, path, body)
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            # (vLLM may merge several tokens' deltas into one chunk: count the tokens by usage.)
            assert chunks[-1]["usage"]["completion_tokens"] == 8
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


async def test_a_stream_with_usage_is_vllms_own_stream(chatml):
    model = chatml.model
    body = chat(model, temperature=0, stream=True, stream_options={"include_usage": True})
    direct = chatml.engines[0]
    # One engine only: the same engine answers both, greedy, so the tokens are the same.
    async with vllm_gateway([direct]) as gw:
        s1, via = await stream_events(gw.port, CHAT, body)
        s2, own = await stream_events(direct.port, CHAT, body)
    assert s1 == s2 == 200
    a, b = normalized(via), normalized(own)
    assert a == b
    assert a["done"] and a["text"] and a["usage"][0]["completion_tokens"] == 8 and a["finish"] == ["length"]


async def test_n_logprobs_and_tools_bodies_get_vllms_answer(chatml):
    model = chatml.model
    direct = chatml.engines[0]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "look a word up",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
            },
        }
    ]
    async with vllm_gateway([direct]) as gw:
        r = await http_request(gw.port, "POST", CHAT, chat(model, n=2), timeout=60)
        assert r.status == 200, r.body
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
        assert r.json()["usage"]["completion_tokens"] == 16

        r = await http_request(gw.port, "POST", CHAT, chat(model, logprobs=True, top_logprobs=2), timeout=60)
        assert r.status == 200, r.body
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 8 and all(len(t["top_logprobs"]) == 2 for t in content)

        for extra in (
            {"tools": tools},
            {"tools": tools, "tool_choice": "none"},
            {"tools": tools, "tool_choice": "auto"},
        ):
            body = chat(model, temperature=0, **extra)
            via = await http_request(gw.port, "POST", CHAT, body, timeout=60)
            own = await http_request(direct.port, "POST", CHAT, body, timeout=60)
            assert via.status == own.status, (extra, via.body, own.body)
            if own.status == 200:
                a, b = via.json(), own.json()
                assert a["choices"] == b["choices"] and a["usage"] == b["usage"]
            else:
                assert via.json()["error"] == own.json()["error"]


async def test_vllms_own_errors_come_through(chatml):
    model = chatml.model
    direct = chatml.engines[0]
    async with vllm_gateway([direct]) as gw:
        # vLLM's 400 for max_tokens past max_model_len (the gateway answers it itself, from
        # the max_model_len it read, with vLLM's type, param and code in its own words).
        for max_tokens in (MAX_MODEL_LEN + 100,):
            body = chat(model, max_tokens=max_tokens)
            via = await http_request(gw.port, "POST", CHAT, body, timeout=60)
            own = await http_request(direct.port, "POST", CHAT, body, timeout=60)
            assert own.status == 400 and via.status == 400, (via.body, own.body)
            a, b = via.json()["error"], own.json()["error"]
            print(f"max_tokens={max_tokens}: gateway {a['message']!r}, vLLM {b['message']!r}")
            assert {k: a[k] for k in ("type", "param", "code")} == {k: b[k] for k in ("type", "param", "code")}

        body = chat("no-such-model")
        via = await http_request(gw.port, "POST", CHAT, body, timeout=60)
        own = await http_request(direct.port, "POST", CHAT, body, timeout=60)
        assert own.status == 404 and via.status == 404, (via.body, own.body)
        assert set(via.json()["error"]) >= {"message", "type", "code"}
        assert "no-such-model" in via.json()["error"]["message"]


async def test_models_and_max_model_len_are_read_from_vllm(chatml):
    async with gateway(chatml) as gw:
        r = await http_request(gw.port, "GET", "/v1/models", timeout=30)
        assert r.status == 200
        assert [m["id"] for m in r.json()["data"]] == [chatml.model]
        await wait_until(
            lambda: all(e.max_model_len for e in gw.endpoints.values()), 10.0, what="max_model_len from vLLM"
        )
        assert {e.max_model_len for e in gw.endpoints.values()} == {MAX_MODEL_LEN}


@pytest.mark.timed  # the verdict is a time (vLLM's own gauge against the clock)
async def test_a_client_that_leaves_mid_stream_frees_vllms_slot_within_a_second(chatml):
    model = chatml.model
    engines = chatml.engines

    def running() -> float:
        return sum(e.metric("vllm:num_requests_running") for e in engines)

    async with gateway(chatml) as gw:
        body = {**chat(model, stream=True), "max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True}
        s = await open_request(gw.port, "POST", CHAT, body, timeout=60)
        assert s.status == 200
        got = 0
        async for _ in s.events():
            got += 1
            if got == 3:
                break
        await wait_until(lambda: _is(running, 1), 10.0, interval=0.05, what="the stream running in vLLM")
        s.abort()
        t0 = time.monotonic()
        await wait_until(lambda: _is(running, 0), 10.0, interval=0.02, what="vLLM to drop the request")
        dropped = time.monotonic() - t0
        print(f"vLLM's num_requests_running dropped {dropped * 1000:.0f} ms after the client left")
        assert dropped < 1.0


async def test_the_learned_batch_is_vllms_max_num_seqs(chatml):
    model = chatml.model
    async with gateway(chatml) as gw:
        body = {**chat(model), "max_tokens": 400, "ignore_eos": True}

        async def client():
            # Closed loop until the test ends: a burst of a fixed count can end (a tiny
            # model's 400 tokens take seconds) before each engine's turn to probe came.
            while True:
                await http_request(gw.port, "POST", CHAT, body, {"x-velocity-priority": "low"}, timeout=120)

        # More than both engines can run at once, in the low band (it queues, never declined).
        tasks = [asyncio.create_task(client()) for _ in range(3 * MAX_NUM_SEQS)]
        try:

            def learned():
                eps = gw.admission.stats()["endpoints"]
                return all(v["batch_capacity"] is not None for v in eps.values())

            await wait_until(learned, 60.0, interval=0.1, what="both engines' batch learned")
            caps = {k: v["batch_capacity"] for k, v in gw.admission.stats()["endpoints"].items()}
            assert set(caps.values()) == {MAX_NUM_SEQS}, caps
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
