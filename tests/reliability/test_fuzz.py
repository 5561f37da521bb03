"""The bounded fuzz run of CI: fixed seeds, a few thousand cases, against a
gateway process in front of a sim engine (tests/reliability/harness.py).

Run twice: as deployed, and with every request traced (docs/tracing.md). Asserted for
every batch: no answer is a 500, no case hangs (every wait is bounded), the gateway
process is alive, velocity_internal_errors_total stays 0, and a valid
request on each route is served after the batch. bench/reliability.py runs the same
generators for as many cases as asked (``--cases``).
"""

from __future__ import annotations

import asyncio
import http.client
import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability import harness as h
from tests.support.otlp import need_otel
from tests.support.sim import free_port

HEAD_CASES = 2400
BODY_CASES = 1500
BATCH = 600


@pytest.fixture(scope="module", params=["untraced", "traced"])
def stack(request):
    """The gateway as deployed, and again with every request traced (its collector down:
    the spans are made and dropped, the answers must not change)."""
    extra = ""
    if request.param == "traced":
        need_otel()
        extra = f"tracing:\n  sample_ratio: 1.0\n  otlp_endpoint: http://127.0.0.1:{free_port()}\n"
    with h.gateway_stack(extra_config=extra) as s:
        yield s


async def check_batch(stack: h.Stack, tally: h.Tally) -> None:
    assert stack.alive(), stack.gw.stderr_text[-3000:]
    assert tally.n500 == 0, (tally.five_hundreds, stack.gw.stderr_text[-3000:])
    assert tally.hangs == 0, tally
    m = await h.metrics(stack.admin_port)
    assert h.total(m, "velocity_internal_errors_total") == 0
    assert h.total(m, "velocity_requests_total", status="500") == 0
    assert await h.served(stack.port), "a valid request was not served after the batch"


@pytest.mark.timeout(150)
async def test_mutated_request_heads(stack):
    """Byte flips, cuts, huge lines, bad and conflicting Content-Length, CL+TE, bare LF,
    NULs and pipelined garbage, from well-formed requests of every route."""
    tally = h.Tally()
    cases = list(h.head_cases(seed=20, count=HEAD_CASES))
    for i in range(0, len(cases), BATCH):
        await h.run_cases(stack.port, cases[i : i + BATCH], tally, concurrency=48)
        await check_batch(stack, tally)
    assert tally.cases == HEAD_CASES
    # the run reached the paths it means to: answers, refusals and read timeouts
    assert tally.statuses[200] > 50 and tally.statuses[400] > 500 and tally.statuses[408] > 10, tally.statuses


@pytest.mark.timeout(150)
async def test_json_bodies_for_every_route(stack):
    """Wrong types for each field, numbers past 64 bits, deep nesting, invalid UTF-8,
    duplicate keys, cut JSON, content parts: each a 2xx or a 4xx, never a 500."""
    tally = h.Tally()
    cases = list(h.body_cases(seed=21, count=BODY_CASES))
    for i in range(0, len(cases), BATCH):
        await h.run_cases(stack.port, cases[i : i + BATCH], tally, concurrency=32)
        await check_batch(stack, tally)
    assert tally.statuses[200] > 100 and tally.statuses[400] > 300, tally.statuses
    # (429 and 503: admission and routing refusing under load on a slow machine)
    assert set(tally.statuses) <= {200, 400, 404, 413, 429, 503}, tally.statuses


# -- Hypothesis: structured bodies, a blocking client, a fixed seed ----------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

_content = st.one_of(
    st.text(max_size=30),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "input_audio"]), "text": st.text(max_size=20)}
        ),
        max_size=3,
    ),
    _json,
)

_chat = st.fixed_dictionaries(
    {
        "model": st.sampled_from([h.MODEL]),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": _content}),
            min_size=1,
            max_size=3,
        ),
    },
    optional={
        "max_tokens": st.integers(min_value=-(2**65), max_value=2**65) | _json,
        "max_completion_tokens": st.integers(min_value=-(2**65), max_value=2**65) | _json,
        "stream": _json,
        "stream_options": _json,
        "priority": _json,
        "sla_ms": _json,
        "user": _json,
        "temperature": _json,
    },
)

_completion = st.fixed_dictionaries(
    {"model": st.sampled_from([h.MODEL]), "prompt": st.text(max_size=30) | _json},
    optional={
        "max_tokens": st.integers(min_value=-(2**65), max_value=2**65) | _json,
        "stream": _json,
        "priority": _json,
        "sla_ms": _json,
        "user": _json,
    },
)

_generate = st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | _json},
    optional={
        "max_tokens": st.integers(min_value=-(2**65), max_value=2**65) | _json,
        "priority": _json,
        "sla_ms": _json,
        "stream": st.booleans() | _json,
        "model": _json,
        "temperature": _json,
    },
)

_cases = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), _chat),
    st.tuples(st.just("/v1/completions"), _completion),
    st.tuples(st.just("/generate"), _generate),
)


def _post(port: int, route: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=h.HANG_S)
    try:
        conn.request("POST", route, body, {"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.timeout(150)
def test_structured_bodies_hypothesis(stack):
    """Hypothesis draws whole request objects (every field any JSON value, integers past
    64 bits, content parts); a stream is read to its end. Never a 500."""
    seen: list[int] = []

    @settings(max_examples=600, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_cases)
    def one(case):
        route, obj = case
        body = h._by_hand(obj)
        status, data = _post(stack.port, route, body)
        seen.append(status)
        assert status != 500, (route, body[:300], data[:300])
        if status >= 400:  # the error shape
            err = json.loads(data)["error"]
            assert set(err) == {"message", "type", "param", "code"}

    one()
    assert stack.alive()
    assert seen.count(200) > 20 and seen.count(400) > 100, (seen.count(200), seen.count(400))
    assert asyncio.run(h.served(stack.port))


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": "ping"}],
        [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
    ],
)
async def test_content_parts_are_forwarded_and_answered(stack, content):
    """OpenAI's content-parts shape is valid: the gateway forwards it and the engine answers 200."""
    body = orjson.dumps({"model": h.MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3})
    out = await h.exchange(stack.port, h.request_bytes("POST", "/v1/chat/completions", body), 10.0)
    assert out.statuses == [200], out.body[:300]
    assert orjson.loads(out.body)["choices"][0]["message"]["content"]
