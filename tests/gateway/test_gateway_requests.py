"""Decoding client requests: only the needed fields, 400s that name the field, and the
body forwarded byte for byte unless the gateway's own fields must go."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.gateway.errors import BadRequest
from velocity_fast.gateway.ingress import band_for, new_request_id
from velocity_fast.gateway.requests import decode_generate, decode_proxy, strip_own_fields


def test_chat_decodes_only_what_it_needs():
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"stream_options":{"include_usage":true},"max_tokens":7,"priority":"high","sla_ms":250,'
        b'"user":"u1","tools":[{"type":"function"}],"logit_bias":{"1":2}}'
    )
    r = decode_proxy(body, chat=True)
    assert (r.model, r.stream, r.max_tokens, r.priority, r.sla_ms, r.user) == ("m", True, 7, "high", 250.0, "u1")
    assert r.stream_options.include_usage is True
    # messages stay raw JSON, as the client wrote them (prefix routing decodes them)
    assert bytes(r.messages) == b'[{"role":"user","content":"hi"}]'
    spaced = decode_proxy(b'{"messages": [ \n {"role": "user"} ]}', chat=True)
    assert bytes(spaced.messages) == b'[ \n {"role": "user"} ]'


def test_completions_prompt_forms():
    for prompt in ('"text"', '["a", "b"]', "[1, 2, 3]", "[[1, 2]]"):
        r = decode_proxy(b'{"prompt": %s}' % prompt.encode(), chat=False)
        assert json.loads(bytes(r.prompt)) == json.loads(prompt)  # kept raw, as the client wrote it


@pytest.mark.parametrize(
    "body, chat, param",
    [
        (b"", True, None),
        (b"{", True, None),
        (b"[]", True, None),
        (b'{"messages": []}', True, "messages"),
        (b'{"model": "m"}', True, "messages"),
        (b'{"messages": "hi"}', True, "messages"),
        (b'{"messages": null}', True, "messages"),
        (b'{"messages": [ \n ]}', True, "messages"),
        (b'{"messages": {"role": "user"}}', True, "messages"),
        (b'{"messages": 5}', True, "messages"),
        (b'{"messages": [{}], "model": 5}', True, "model"),
        (b'{"messages": [{}], "stream": "yes"}', True, "stream"),
        (b'{"messages": [{}], "max_tokens": 0}', True, "max_tokens"),
        (b'{"messages": [{}], "max_completion_tokens": -1}', True, "max_completion_tokens"),
        (b'{"messages": [{}], "max_tokens": 1.5}', True, "max_tokens"),
        (b'{"messages": [{}], "sla_ms": 0}', True, "sla_ms"),
        (b'{"messages": [{}], "priority": 1.5}', True, "priority"),
        (b'{"messages": [{}], "stream_options": {"include_usage": true}}', True, "stream_options"),
        (b'{"messages": [{}], "stream": false, "stream_options": {}}', True, "stream_options"),
        (b'{"messages": [{}], "stream": true, "stream_options": {"include_usage": "yes"}}', True, "stream_options"),
        (b'{"model": "m"}', False, "prompt"),
        (b'{"prompt": ""}', False, "prompt"),
        (b'{"prompt": []}', False, "prompt"),
        (b'{"prompt": {"a": 1}}', False, "prompt"),
    ],
)
def test_proxy_bad_requests_name_the_field(body, chat, param):
    with pytest.raises(BadRequest) as ei:
        decode_proxy(body, chat)
    assert ei.value.param == param
    assert str(ei.value)


@pytest.mark.parametrize(
    "body, chat, message",
    [
        (b"", True, "The request body is empty; a JSON object is expected."),
        (b'{"messages": []}', True, "`messages` is required and must be a non-empty list."),
        (b'{"prompt": []}', False, "`prompt` is required."),
        (b'{"messages": [{}], "max_tokens": 0}', True, "`max_tokens` must be at least 1, got 0."),
        (
            b'{"messages": [{}], "max_completion_tokens": -1}',
            True,
            "`max_completion_tokens` must be at least 1, got -1.",
        ),
        (b'{"messages": [{}], "sla_ms": 0}', True, "`sla_ms` must be positive, got 0.0."),
        (b'{"messages": [{}], "sla_ms": -2.5}', True, "`sla_ms` must be positive, got -2.5."),
        (b'{"messages": [{}], "stream_options": {}}', True, "Stream options can only be defined when `stream=True`."),
    ],
)
def test_proxy_bad_request_messages(body, chat, message):
    with pytest.raises(BadRequest) as ei:
        decode_proxy(body, chat)
    assert str(ei.value) == message


def test_decode_errors_carry_msgspec_text():
    with pytest.raises(BadRequest, match=r"^Invalid request: .*\$\.model") as ei:
        decode_proxy(b'{"messages": [{}], "model": 5}', True)
    assert ei.value.param == "model"
    with pytest.raises(BadRequest, match="^The request body is not valid JSON: ") as ei:
        decode_proxy(b'{"messages": [{}]} x', True)
    assert ei.value.param is None


def test_request_path_is_compiled():
    """The proxy path calls the decoder as C (ingress.pyx): compiled functions, not Python ones."""
    import inspect

    for f in (decode_proxy, strip_own_fields, decode_generate):
        assert not inspect.isfunction(f), f
    assert issubclass(BadRequest, ValueError)
    with pytest.raises(TypeError):  # a typed argument, not a crash
        strip_own_fields(None, decode_proxy(b'{"prompt": "x"}', False))


def test_generate_defaults_and_errors():
    r = decode_generate(b'{"prompt": "hello"}')
    assert (r.prompt, r.max_tokens, r.stream, r.priority, r.sla_ms) == ("hello", 128, False, None, None)
    r = decode_generate(b'{"prompt": "x", "max_tokens": 3, "priority": 0, "sla_ms": 100, "stream": true}')
    assert (r.max_tokens, r.priority, r.sla_ms, r.stream) == (3, 0, 100.0, True)
    for body, param in (
        (b'{}', "prompt"),
        (b'{"prompt": 3}', "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "sla_ms": -1}', "sla_ms"),
        (b'', None),
        (b'nope', None),
    ):
        with pytest.raises(BadRequest) as ei:
            decode_generate(body)
        assert ei.value.param == param, body


def _strip(body: bytes, chat: bool = False) -> bytes:
    return strip_own_fields(body, decode_proxy(body, chat))


def test_body_without_own_fields_is_the_same_object():
    body = b'{"prompt":  "x",\n "temperature": 0.70, "seed": 1}'
    assert _strip(body) is body


def test_own_fields_removed_rest_kept_exactly():
    body = b'{"prompt": "x", "priority": "high", "seed": 123456789012345678901234, "t": 0.50, "sla_ms": 9}'
    out = _strip(body)
    assert b"priority" not in out and b"sla_ms" not in out
    assert b"123456789012345678901234" in out and b"0.50" in out
    assert json.loads(out) == {"prompt": "x", "seed": 123456789012345678901234, "t": 0.50}


def test_nested_or_quoted_priority_is_not_touched():
    body = b'{"prompt": "say \\"priority\\"", "metadata": {"priority": 1, "sla_ms": 2.50}}'
    assert _strip(body) == body
    chat = b'{"messages": [{"role": "user", "content": "x", "priority": 3}]}'
    assert _strip(chat, chat=True) == chat


def test_null_own_field_is_removed_too():
    out = _strip(b'{"prompt": "x", "priority": null}')
    assert json.loads(out) == {"prompt": "x"}
    out = _strip(b'{"prompt": "x", "sla_ms": null}')
    assert json.loads(out) == {"prompt": "x"}


def test_the_decoded_request_tells_an_absent_own_field_from_a_null_one():
    # Absent: UNSET, and the body goes on untouched without being searched; null: None.
    import msgspec

    r = decode_proxy(b'{"prompt": "x"}', chat=False)
    assert r.priority is msgspec.UNSET and r.sla_ms is msgspec.UNSET
    r = decode_proxy(b'{"prompt": "x", "priority": null, "sla_ms": null}', chat=False)
    assert r.priority is None and r.sla_ms is None


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(
    extra=st.dictionaries(
        st.text(max_size=8).filter(
            lambda k: (
                k
                not in (
                    "priority",
                    "sla_ms",
                    "prompt",
                    "model",
                    "messages",
                    "stream",
                    "stream_options",
                    "max_tokens",
                    "max_completion_tokens",
                    "user",
                )
            )
        ),
        _values,
        max_size=4,
    ),
    prio=st.one_of(st.none(), st.sampled_from(["high", "low"]), st.integers(0, 3)),
    sla=st.one_of(st.none(), st.floats(1, 1e6)),
)
def test_strip_keeps_every_other_field(extra, prio, sla):
    obj = {"prompt": "p", **extra}
    if prio is not None:
        obj["priority"] = prio
    if sla is not None:
        obj["sla_ms"] = sla
    body = json.dumps(obj).encode()
    out = _strip(body)
    want = {k: v for k, v in obj.items() if k not in ("priority", "sla_ms")}
    assert json.loads(out) == want
    if prio is None and sla is None:
        assert out == body


def test_request_ids_are_unique_and_shaped_as_documented():
    ids = [new_request_id() for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"req-[0-9a-f]{12}", i) for i in ids)
    assert len({i[:10] for i in ids}) == 1  # one prefix per process, a counter after it


class _Tenant:
    def __init__(self, max_band):
        self.max_band = max_band


def test_band_for_names_numbers_defaults_and_tenant_caps():
    names = ["high", "normal", "low"]
    assert band_for(names, None, None) == "normal" and band_for(names, "", None) == "normal"
    assert band_for(["a", "b", "c", "d"], None, None) == "c"  # no "normal": the middle band
    assert band_for(names, " HIGH ", None) == "high"
    # vLLM's number: 0, its default (which clients written for vLLM send), is the default
    # band; lower runs earlier, a band a step, to the first or the last.
    assert [band_for(names, n, None) for n in (-3, -1, 0, 1, 2, 9)] == ["high", "high", "normal", "low", "low", "low"]
    five = ["p0", "p1", "p2", "p3", "p4"]
    assert [band_for(five, n, None) for n in (-9, -1, 0, 1, 2)] == ["p0", "p1", "p2", "p3", "p4"]
    # Counted from admission.default_band where it is set, not from the middle.
    assert [band_for(names, n, None, "low") for n in (-2, -1, 0, 5)] == ["high", "normal", "low", "low"]
    assert band_for(names, 0, _Tenant("normal"), "high") == "normal"  # and capped by the tenant
    assert band_for(names, "high", _Tenant("normal")) == "normal"  # capped by the tenant
    assert band_for(names, "low", _Tenant("normal")) == "low"  # a cap never raises a band
    with pytest.raises(BadRequest, match="Unknown priority band") as e:
        band_for(names, True, None)  # a bool is not a vLLM priority number
    assert e.value.param == "priority"
