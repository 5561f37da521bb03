"""Prefix block hashes straight from request bytes (velocity_fast/routing/blockscan.pyx).

The reference is what the router hashes today: render_prompt of the decoded body
(routing/prefix_render.py), cut into blocks by PrefixHasher. The scanner must give the
same blocks wherever it answers, and answer None (the caller renders in Python) for
what it does not take.
"""

import json
import random

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velocity_fast.gateway.request_types import ProxyRequest
from velocity_fast.gateway.requests import decode_proxy
from velocity_fast.routing import blockscan
from velocity_fast.routing.prefix import PrefixHasher
from velocity_fast.routing.prefix_render import render_prompt

HASHER = PrefixHasher(64)
MODEL = "m"
_decode = msgspec.json.Decoder()
_request = msgspec.json.Decoder(ProxyRequest)


def decoded(body: bytes):
    """The body as the gateway's decoder leaves it (messages and prompt kept raw); a
    prompt decode_proxy refuses (not a string, list or null) raises, as it does."""
    r = _request.decode(body)
    if r.prompt and bytes(r.prompt)[:1] not in (b'"', b"[", b"n"):
        raise ValueError("decode_proxy refuses this prompt")
    return r


def reference(body: bytes, hasher=HASHER) -> list:
    """The router's blocks today: the decoded body rendered in Python, then hashed."""
    return hasher.hash(render_prompt(decoded(body)), MODEL).tolist()


def scanned(body: bytes, hasher=HASHER):
    out = blockscan.hash_body(body, hasher, MODEL)
    return None if out is None else out.tolist()


def assert_same(body: bytes, hasher=HASHER) -> None:
    assert blockscan.render_body(body) == render_prompt(decoded(body))
    assert scanned(body, hasher) == reference(body, hasher)


# -- a conversation's next turn extends its blocks ---------------------------------------


def _turns(parts: bool):
    rng = random.Random(7)
    words = "the of a prompt cache block engine route token reply \"quoted\" tab\there é 日本 😀".split(" ")

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n)) + "\n"

    def msg(role, n):
        t = text(n)
        return {"role": role, "content": [{"type": "text", "text": t}] if parts else t}

    convo = [msg("system", 60)]
    turns = []
    for i in range(5):
        convo = convo + [msg("user", 30 + 7 * i)]
        turns.append(list(convo))
        convo = convo + [msg("assistant", 40)]
    return turns


@pytest.mark.parametrize("parts", [False, True], ids=["string-content", "content-parts"])
def test_each_chat_turn_extends_the_blocks_of_the_previous_turn(parts):
    previous = None
    for messages in _turns(parts):
        body = orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 8})
        blocks = scanned(body)
        assert blocks == reference(body)
        if previous is not None:
            assert len(blocks) > len(previous) > 0
            assert blocks[: len(previous)] == previous
        previous = blocks


def test_content_parts_give_the_blocks_of_the_equivalent_string_content():
    for plain, parts in zip(_turns(False), _turns(True)):
        a = scanned(orjson.dumps({"messages": plain}))
        b = scanned(orjson.dumps({"messages": parts}))
        assert a == b and len(a) > 3
    # A text split over several parts is the same text.
    one = {"messages": [{"role": "user", "content": "x" * 100 + "y" * 100}]}
    split = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x" * 100}, {"text": "y" * 100, "type": "text"}]}
        ]
    }
    assert scanned(orjson.dumps(one)) == scanned(orjson.dumps(split)) == reference(orjson.dumps(one))


def test_completions_text_and_token_prompts_extend_as_they_grow():
    text = "".join(f"line {i}: some prompt text\n" for i in range(60))
    tokens = list(range(1000, 1400))
    for short, long in [(text[:700], text), (tokens[:150], tokens)]:
        a = scanned(orjson.dumps({"model": MODEL, "prompt": short}))
        b = scanned(orjson.dumps({"model": MODEL, "prompt": long}))
        assert a == reference(orjson.dumps({"prompt": short}))
        assert b == reference(orjson.dumps({"prompt": long}))
        assert len(b) > len(a) > 0 and b[: len(a)] == a
    # A batch is routed by its first prompt.
    assert scanned(orjson.dumps({"prompt": [text, "other"]})) == scanned(orjson.dumps({"prompt": text}))


def test_a_different_earlier_message_changes_every_later_block():
    turn = _turns(False)[2]
    other = [dict(turn[0], content="Another system prompt entirely.\n" * 4)] + turn[1:]
    a = scanned(orjson.dumps({"messages": turn}))
    b = scanned(orjson.dumps({"messages": other}))
    assert a[0] != b[0] and not set(a) & set(b)


# -- the same blocks as the Python rendering --------------------------------------------


def test_shapes_the_rendering_knows():
    bodies = [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"content": "late role", "name": "ann", "role": "user"}]},
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{\"a\": [1, \"\\n\"]}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"detail": "low", "url": "data:image/png;base64,AAAA"}},
                        {"type": "input_audio", "input_audio": {"format": "wav", "data": "UklGR"}},
                        {"type": "image_url", "image_url": "not an object"},
                        {"type": "image_url"},
                        {"type": "video", "z": {"b": [1, None, True], "a": {}}},
                        {"text": "no type"},
                        {"type": "text"},
                        {"type": "text", "text": None},
                        {"type": "text", "text": {"k": -3}},
                        "a string part",
                        7,
                        None,
                        [1, "x"],
                    ],
                }
            ]
        },
        {
            "messages": [
                1,
                "x",
                None,
                [],
                {},
                {"role": None},
                {"role": {"b": 1, "a": False}, "content": 0},
                {"role": "u", "name": "", "tool_calls": [], "tool_call_id": 0, "content": True},
                {"role": "u", "name": 5, "tool_calls": "s", "tool_call_id": "id"},
            ]
        },
        {"messages": "a string", "prompt": "unused"},
        {"messages": {"b": 2, "a": [1]}},
        {"messages": [], "prompt": "empty messages: the prompt decides"},
        {"messages": None, "prompt": [1, 2, 3]},
        {"messages": False, "prompt": "x"},
        {"prompt": "héllo"},
        {"prompt": [0, 4294967295, True, False]},
        {"prompt": [1, -1]},
        {"prompt": [1, 4294967296]},
        {"prompt": [5, "x"]},
        {"prompt": [[5, 6], [7]]},
        {"prompt": [["a"], "b"]},
        {"prompt": [[], "b"]},
        {"prompt": [True, 1]},
        {"prompt": [None]},
        {"prompt": [{"b": 1, "a": 2}]},
        {"prompt": [{"u64": 2**64 - 1, "i64": -(2**63), "z": -0}]},
        {"prompt": []},
        {"prompt": None},
        {},
        {
            "model": "m",
            "stream": True,
            "tools": [{"type": "function", "function": {"parameters": {"x": 1.5}}}],
            "messages": [{"role": "user", "content": "floats elsewhere are only checked", "weight": 0.5}],
        },
    ]
    for body in bodies:
        assert_same(orjson.dumps(body))


def test_key_order_whitespace_and_escapes_of_the_json_do_not_matter():
    msg = {
        "messages": [
            {"role": "system", "content": "Tabs\tand \"quotes\" and \\ and é and 😀 and \u2028"},
            {"role": "user", "content": [{"type": "text", "text": "ctl \x01\x1f\x7f"}], "name": "n\u00e9"},
        ]
    }
    forms = [
        orjson.dumps(msg),
        json.dumps(msg).encode(),  # \uXXXX escapes, surrogate pairs
        json.dumps(msg, ensure_ascii=False, indent=2).encode(),
        json.dumps(msg, separators=(" , ", " : ")).encode(),
    ]
    for body in forms:
        assert_same(body)
    assert len({tuple(scanned(b)) for b in forms}) == 1
    # Escaped keys and escaped type names are the same keys.
    body = rb'{"m\u0065ssages":[{"r\u006fle":"user","content":[{"type":"te\u0078t","text":"a\/b"}]}]}'
    assert_same(body)
    assert blockscan.render_body(body) == b"\x1euser\x1fa/b"


def test_a_repeated_key_takes_its_last_value_as_the_decoder_does():
    bodies = [
        b'{"messages":[{"role":"user","content":"first"}],"messages":[{"role":"user","content":"second"}]}',
        b'{"messages":[{"role":"user","content":"first"}],"messages":[],"prompt":"p"}',
        b'{"messages":[],"messages":[{"role":"a","content":"b"}]}',
        b'{"prompt":"a","prompt":[1,2]}',
        b'{"messages":[{"role":"a","content":"x","role":"b","content":[{"type":"text","text":"y"}]}]}',
        b'{"messages":[{"role":"a","content":[{"type":"text","text":"y","type":"image_url","image_url":{"url":"u"}}]}]}',
        b'{"messages":[{"role":"a","content":[{"text":"y","type":"text","text":"z"}]}]}',
        b'{"messages":[{"role":"a","content":[{"text":"y","type":"text","text":null}]}]}',
        b'{"messages":[{"role":"a","tool_calls":[{"k":1,"j":2,"k":3}],"content":""}]}',
    ]
    for body in bodies:
        assert_same(body)


def test_hash_messages_reads_the_raw_messages_the_decoder_keeps():
    body = orjson.dumps({"model": MODEL, "messages": _turns(True)[3]})
    r = decode_proxy(body, True)
    out = blockscan.hash_messages(r.messages, HASHER, MODEL)
    assert out.tolist() == HASHER.hash(render_prompt(r), MODEL).tolist()
    assert (out.seed, out.block_bytes) == (HASHER.seed_for(MODEL), 64)
    assert blockscan.render_messages(r.messages) == render_prompt(r)
    # Not a non-empty array: the prompt would decide, so the caller renders.
    for raw in (b"[]", b" [ ] ", b'"x"', b"null", b"", b"[1"):
        assert blockscan.hash_messages(raw, HASHER, MODEL) is None


@pytest.mark.parametrize("block", [32, 64, 96, 4096])
def test_any_block_size_and_the_model_seed(block):
    hasher = PrefixHasher(block)
    body = _chat_body(16)
    assert len(scanned(body, hasher)) >= 3
    assert scanned(body, hasher) == reference(body, hasher)
    other = blockscan.hash_body(body, hasher, "another-model").tolist()
    assert other != scanned(body, hasher) and len(other) == len(scanned(body, hasher))


# -- generated bodies --------------------------------------------------------------------

_ints = st.integers(-(2**63), 2**64 - 1) | st.integers(0, 2**32 + 2)  # orjson's range
_leaf = st.none() | st.booleans() | _ints | st.text(max_size=20)
_json = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_text = st.text(max_size=300)
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("text")}, optional={"text": _json}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries({"url": st.text(max_size=40)}, optional={"detail": st.just("low")})
            | _json,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries({"data": st.text(max_size=40)})}
    ),
    _json,
)
_message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool"]),
            "content": _text | st.lists(_part, max_size=4) | st.none(),
        },
        optional={
            "name": st.text(max_size=8) | _json,
            "tool_calls": _json,
            "tool_call_id": st.text(max_size=8) | _json,
            "extra": _json,
        },
    ),
    st.fixed_dictionaries({}, optional={"role": _json, "content": _json}),
    _json,
)
_token_ids = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40)
_prompt = st.one_of(st.none(), _text, _token_ids, st.lists(_text | _token_ids, max_size=3), st.lists(_json, max_size=4))
_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL),
        "messages": st.lists(_message, max_size=6) | _json,
        "prompt": _prompt,
        "temperature": st.just(0.7),
        "extra_body": _json,
    },
)


def _shuffled(value, rng):
    """value with every object's keys in another order (a dict keeps insertion order)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def _encode(body, style: int) -> bytes:
    if style == 0:
        return orjson.dumps(body)
    if style == 1:
        return json.dumps(body).encode()  # every non-ASCII character escaped
    return json.dumps(body, ensure_ascii=False, indent=1).encode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_body, style=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_generated_bodies_give_the_python_renderings_blocks(body, style, seed):
    raw = _encode(_shuffled(body, random.Random(seed)), style)
    # Without floats where the rendering would write canonical JSON, nothing is left over.
    assert blockscan.render_body(raw) == render_prompt(decoded(raw))
    assert scanned(raw) == reference(raw)
    messages = decoded(raw).messages
    if messages and _decode.decode(messages) and isinstance(_decode.decode(messages), list):
        assert blockscan.hash_messages(messages, HASHER, MODEL).tolist() == reference(raw)


_any_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
_any_json = st.recursive(
    _any_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(_any_json, min_size=1, max_size=4), prompt=_any_json)
def test_floats_and_huge_integers_are_left_to_python_or_rendered_the_same(messages, prompt):
    for body in ({"messages": messages}, {"prompt": prompt}):
        try:
            raw = orjson.dumps(body)
        except TypeError:  # an integer past 64 bits
            raw = json.dumps(body).encode()
        try:
            expected = render_prompt(decoded(raw))
        except Exception:  # the gateway answers 400: no routing
            expected = None
        got = blockscan.render_body(raw)
        assert got is None or got == expected
        if got is None and expected is not None:  # only a float or an integer past 64 bits is left over
            assert _has_float_or_huge_int(body)


def _has_float_or_huge_int(value) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(2**63) <= value < 2**64
    if isinstance(value, dict):
        return any(_has_float_or_huge_int(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float_or_huge_int(v) for v in value)
    return False


# -- what is not taken falls back, never raises -----------------------------------------

MALFORMED = [
    b"",
    b" ",
    b"[]",
    b'"x"',
    b"null",
    b"{",
    b"}",
    b"{]",
    b'{"messages":}',
    b'{"messages":[1,]}',
    b'{"messages":[{"role":"u",}]}',
    b'{"messages" [1]}',
    b'{messages:[1]}',
    b'{"messages":[1] x}',
    b'{"messages":[1]}{}',
    b'{"prompt":01}',
    b'{"prompt":1.}',
    b'{"prompt":-}',
    b'{"prompt":tru}',
    b'{"prompt":"\\a"}',
    b'{"prompt":"\\u12"}',
    b'{"prompt":"\\ud800"}',
    b'{"prompt":"\\udc00x"}',
    b'{"prompt":"\\ud800\\u0041"}',
    b'{"prompt":"a\x01b"}',
    b'{"prompt":"\xff"}',
    b'{"prompt":"\xc3"}',
    b'{"prompt":"\xed\xa0\x80"}',
    b'{"prompt":"\xc0\xaf"}',
    b'{"prompt":"\xf4\x90\x80\x80"}',
    b'{"prompt":"unterminated',
    b'\xef\xbb\xbf{"prompt":"bom"}',
    b'{"prompt":NaN}',
    b'{"prompt":5}',
    b'{"prompt":{"a":1}}',
    b'{"prompt":true}',  # types the decoder refuses
    b'{"messages":[{"role":1.5,"content":"x"}]}',
    b'{"messages":[{"role":"u","content":[{"x":1e3}]}]}',
    b'{"messages":[{"role":"u","name":0.0,"content":"x"}]}',
    b'{"messages":1.5}',
    b'{"messages":[{"role":"u","tool_calls":[18446744073709551616]}]}',
    b'{"messages":[{"role":"u","tool_calls":[-9223372036854775809]}]}',
    b'{"messages":' + b"[" * 70 + b"]" * 70 + b"}",
]


@pytest.mark.parametrize("body", MALFORMED)
def test_what_the_scanner_does_not_take_gives_none(body):
    assert blockscan.hash_body(body, HASHER, MODEL) is None
    assert blockscan.render_body(body) is None


def test_nesting_within_the_bound_is_taken():
    deep = b'{"messages":[{"role":"u","content":[{"type":"x","v":' + b"[" * 50 + b"]" * 50 + b"}]}]}"
    assert_same(deep)


def test_every_truncation_of_a_body_gives_none():
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "héllo \"x\"\n"}], "name": "a"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "args": [1, True, None]}]},
            ],
            "prompt": [1, 2],
        }
    )
    assert scanned(body) == reference(body)
    for n in range(len(body)):
        assert blockscan.hash_body(body[:n], HASHER, MODEL) is None


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_corrupted_bodies_fall_back_or_match_what_still_decodes(data):
    body = bytearray(orjson.dumps({"messages": _turns(True)[1][:3], "prompt": [1, 2, 3]}))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    raw = bytes(body)
    got = blockscan.render_body(raw)
    try:
        expected = render_prompt(decoded(raw))
    except Exception:
        expected = None  # refused by the gateway
    assert got is None or got == expected


@settings(max_examples=300, deadline=None)
@given(
    raw=st.binary(max_size=200)
    | st.builds(
        lambda a, b: a + b,
        st.sampled_from(
            [b'{"messages":[{"role":"', b'{"prompt":[', b'{"messages":[{"content":[{"type":"text","text":"']
        ),
        st.binary(max_size=60),
    )
)
def test_arbitrary_bytes_fall_back_or_match_what_still_decodes(raw):
    try:
        expected = render_prompt(decoded(raw))
    except Exception:
        expected = None
    got = blockscan.render_body(raw)
    assert got is None or got == expected
    if expected is None:
        assert got is None
    blockscan.hash_messages(raw, HASHER, MODEL)  # (any bytes: no exception)


# -- large bodies ------------------------------------------------------------------------


def _chat_body(kib: int, parts: bool = False) -> bytes:
    rng = random.Random(kib)
    words = ["alpha", "beta", "gamma", "dé", "\"q\"", "tab\t", "line\n", "日本語", "😀"]
    messages = [{"role": "system", "content": "You are a careful assistant."}]
    while len(orjson.dumps(messages)) < kib * 1024 - 400:
        text = " ".join(rng.choice(words) for _ in range(200))
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": [{"type": "text", "text": text}] if parts else text})
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 16})


@pytest.mark.parametrize("kib", [256, 1024])
def test_large_bodies(kib):
    for parts in (False, True):
        body = _chat_body(kib, parts)
        assert len(body) > (kib - 1) * 1024
        blocks = scanned(body)
        assert len(blocks) > kib * 1024 // 64 // 2
        assert blocks == reference(body)


@pytest.mark.parametrize("ensure_ascii", [False, True], ids=["utf-8", "u-escapes"])
def test_long_runs_of_another_script_in_both_encodings(ensure_ascii):
    rng = random.Random(5)
    chars = "日本語の文章はここにありますテストキャッシュ한국어😀é"
    messages = [
        {
            "role": "user" if i % 2 else "assistant",
            "content": "".join(rng.choice(chars) + ("\n" if rng.random() < 0.02 else "") for _ in range(3000)),
        }
        for i in range(30)
    ]
    body = json.dumps({"model": MODEL, "messages": messages}, ensure_ascii=ensure_ascii).encode()
    assert len(body) > 200 * 1024
    assert_same(body)
