"""The sim engine's routes beyond chat (sim/extra.py), asked directly: embeddings,
detokenize (byte model and real tokenizer), GET /v1/models/{id}, and the Responses and
Messages APIs whole and streamed, in vLLM's shapes, with their errors."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys

import pytest

from tests.support.sim import sim_engine
from velocity_fast.sim.tokens import render_text

MODEL = "sim-model"


def _post(eng, path: str, body) -> tuple[int, bytes]:
    return eng.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


@pytest.fixture(scope="module")
def eng():
    with sim_engine(model=MODEL, time_scale=50) as e:
        yield e


def test_embeddings_are_deterministic_unit_vectors_float_or_base64(eng):
    s, b = _post(eng, "/v1/embeddings", {"model": MODEL, "input": ["a cat", "a dog"], "dimensions": 8})
    assert s == 200
    body = json.loads(b)
    v1, v2 = (d["embedding"] for d in body["data"])
    assert len(v1) == 8 and v1 != v2 and abs(sum(x * x for x in v1) - 1.0) < 1e-4
    assert body["usage"]["prompt_tokens"] > 0
    s, b = _post(eng, "/v1/embeddings", {"input": "a cat", "dimensions": 8, "encoding_format": "base64"})
    packed = base64.b64decode(json.loads(b)["data"][0]["embedding"])
    assert [round(x, 5) for x in struct.unpack("<8f", packed)] == [round(x, 5) for x in v1]
    assert _post(eng, "/v1/embeddings", {"input": []})[0] == 400
    s, b = _post(eng, "/v1/embeddings", {"model": "other", "input": "x"})
    assert s == 404 and json.loads(b)["error"]["type"] == "NotFoundError"


def test_models_by_id_is_not_a_vllm_route(eng):
    # vLLM 0.32 has no GET /v1/models/{id}: its router's 404, for a known model too.
    for path in (f"/v1/models/{MODEL}", "/v1/models/other"):
        s, b = eng.get(path)
        assert (s, json.loads(b)) == (404, {"detail": "Not Found"})


def test_responses_whole_and_streamed(eng):
    s, b = _post(eng, "/v1/responses", {"input": "hello", "instructions": "be brief", "max_output_tokens": 4})
    assert s == 200
    r = json.loads(b)
    assert r["object"] == "response" and r["status"] == "incomplete"  # cut by max_output_tokens, as vLLM's
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["output_tokens"] == 4 and r["usage"]["total_tokens"] == r["usage"]["input_tokens"] + 4
    s, b = _post(
        eng,
        "/v1/responses",
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "max_output_tokens": 3,
            "stream": True,
        },
    )
    evs = _events(b)
    assert evs[0][0] == "response.created" and evs[-1][0] == "response.completed"
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    deltas = [d["delta"] for k, d in evs if k == "response.output_text.delta"]
    assert len(deltas) == 3
    done = evs[-1][1]["response"]
    assert done["usage"]["output_tokens"] == 3 and done["output"][0]["content"][0]["text"] == "".join(deltas)
    assert _post(eng, "/v1/responses", {"input": "x", "max_output_tokens": 0})[0] == 400
    assert _post(eng, "/v1/responses", {"max_output_tokens": 3})[0] == 400


def test_messages_whole_and_streamed_with_anthropic_errors(eng):
    msgs = [{"role": "user", "content": "hi"}]
    s, b = _post(eng, "/v1/messages", {"model": MODEL, "messages": msgs, "max_tokens": 5})
    m = json.loads(b)
    assert s == 200 and m["type"] == "message" and m["stop_reason"] == "max_tokens"
    assert m["usage"]["output_tokens"] == 5 and m["usage"]["input_tokens"] > 0
    s, b = _post(eng, "/v1/messages", {"model": MODEL, "messages": msgs, "max_tokens": 2, "stream": True})
    kinds = [k for k, _ in _events(b)]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert _events(b)[5][1]["usage"]["output_tokens"] == 2
    s, b = _post(eng, "/v1/messages", {"model": MODEL, "messages": msgs})  # max_tokens is required
    assert s == 400 and json.loads(b)["type"] == "error"
    s, b = _post(eng, "/v1/messages", {"model": "other", "messages": msgs, "max_tokens": 2})
    assert s == 404 and json.loads(b)["error"]["type"] == "not_found_error"


def test_detokenize_inverts_tokenize_with_a_real_tokenizer(tmp_path):
    path = subprocess.run(
        [sys.executable, "-m", "velocity_fast.sim", "--write-tokenizer", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    with sim_engine("--tokenizer", path, model=MODEL, time_scale=50) as e:
        text = render_text([5, 6, 7]).strip()  # words the written tokenizer knows
        s, b = _post(e, "/tokenize", {"prompt": text})
        ids = json.loads(b)["tokens"]
        s, b = _post(e, "/detokenize", {"tokens": ids})
        assert s == 200 and json.loads(b)["prompt"].replace(" ", "") == text.replace(" ", "")
        assert _post(e, "/detokenize", {"tokens": "nope"})[0] == 400
