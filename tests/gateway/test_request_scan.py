"""The request scanner (csrc/reqscan.h) under decode_proxy and strip_own_fields: a body of
3 KiB or more decodes to what msgspec makes of the whole body, is refused where msgspec
refuses it (with msgspec's words), and keeps its prompt as compact JSON text that hashes
the same however the client spaced it."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.gateway.errors import BadRequest
from velocity_fast.gateway.request_types import ProxyRequest
from velocity_fast.gateway.requests import decode_proxy, decode_proxy_compact, scan_isa, scan_members, strip_own_fields
from velocity_fast.routing.blockscan import hash_json
from velocity_fast.routing.prefix import PrefixHasher
from velocity_fast.routing.prefix_render import json_text

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, params=["avx512", "avx2", "sse2"])
def walk(request):
    """Every test here runs with each of the scanner's string walks (AVX-512 and AVX2
    where the CPU has them, else the best below; the CPU's choice is restored after)."""
    yield scan_isa(request.param)
    scan_isa("auto")


def _cpu_flags() -> set[str]:
    import re
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    m = re.search(r"^flags\s*:(.*)$", info.read_text() if info.exists() else "", re.M)
    return set(m.group(1).split()) if m else set()


def test_the_scanner_uses_the_cpus_best_walk_unless_told():
    flags = _cpu_flags()
    best = "avx512" if {"avx512f", "avx512bw", "avx512_vbmi2"} <= flags else "avx2" if "avx2" in flags else "sse2"
    assert scan_isa("auto") == best
    assert scan_isa("sse2") == "sse2"
    # One the CPU lacks gives the best below it.
    assert scan_isa("avx512") == best
    assert scan_isa("avx2") == ("sse2" if best == "sse2" else "avx2")
    with pytest.raises(ValueError):
        scan_isa("neon")


WHOLE = msgspec.json.Decoder(ProxyRequest)
FIELDS = ("model", "stream", "max_tokens", "max_completion_tokens", "priority", "sla_ms", "user")
PAD = "A careful answer, with \"quotes\", a café, tabs\tand lines\n. " * 40  # about 2.3 KiB
HASHER = PrefixHasher(64)


def _chat(n_turns=3, **extra):
    msgs = [{"role": "system", "content": PAD}]
    for i in range(n_turns):
        msgs.append({"role": "user", "content": f"question {i}: " + PAD[: 200 + 37 * i]})
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i} " + PAD[:150]}]})
    return {"model": "m", "messages": msgs, **extra}


def _dump(obj, style):
    if style == "compact":
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    if style == "spaced":
        return json.dumps(obj, ensure_ascii=False).encode()
    return json.dumps(obj, indent=2, ensure_ascii=False).encode()


def _same_as_whole(body: bytes, chat: bool):
    r, compact = decode_proxy_compact(body, chat)
    w = WHOLE.decode(body)
    for f in FIELDS:
        assert getattr(r, f) == getattr(w, f), f
    assert r.stream_options == w.stream_options
    for f in ("messages", "prompt"):
        assert msgspec.json.decode(getattr(r, f) or b"null") == msgspec.json.decode(getattr(w, f) or b"null"), f
    return r, compact


@pytest.mark.parametrize("style", ["compact", "spaced", "indented"])
def test_a_large_chat_body_decodes_as_msgspec_decodes_it_whole(style):
    body = _dump(
        _chat(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=77,
            priority="high",
            sla_ms=2500,
            user="u",
            tools=[{"type": "function", "function": {"name": "f"}}],
            temperature=0.25,
            seed=123456789012345678901234,
        ),
        style,
    )
    assert len(body) > 4096
    r, compact = _same_as_whole(body, True)
    assert compact, "a body the scanner takes leaves compact prompt text"
    # compact, escapes as written
    assert bytes(r.messages) == _dump(json.loads(body)["messages"], "compact")


@given(
    st.dictionaries(
        st.sampled_from(["model", "stream", "max_tokens", "user", "x", "n", "logprobs"]),
        st.one_of(st.none(), st.booleans(), st.integers(1, 2**31 - 1), st.text(max_size=20)),
        max_size=5,
    ),
    st.sampled_from(["compact", "spaced", "indented"]),
)
@settings(max_examples=150, deadline=None)
def test_any_large_body_decodes_or_fails_as_msgspec_does(fields, style):
    obj = dict(fields)
    obj["messages"] = [{"role": "user", "content": PAD * 2}]
    body = _dump(obj, style)
    try:
        WHOLE.decode(body)
    except msgspec.ValidationError:
        with pytest.raises(BadRequest):
            decode_proxy(body, True)
        return
    assert _same_as_whole(body, True)[1], "the scanner took it"


def _big(inner: bytes) -> bytes:
    return b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 4000 + inner + b'"}],"max_tokens":5}'


@pytest.mark.parametrize(
    "bad",
    [
        _big(b"\x01"),  # a control byte in a string
        _big(b"\\q"),  # not an escape
        _big(b"\\u12"),  # a short \u escape
        _big(b"\\ud800"),  # a lone high surrogate
        _big(b"\\udc00x"),  # a lone low surrogate
        _big(b"") + b",",  # a trailing comma at the end
        _big(b"")[:-1] + b",}",  # a trailing comma in the object
        _big(b"")[:-1],  # truncated
        _big(b"")[:-1] + b',"n":01}',  # a leading zero
        _big(b"")[:-1] + b',"n":1.}',  # a bare decimal point
        _big(b"")[:-1] + b',"n":tru}',  # a broken literal
        _big(b"")[:-1] + b',"n":NaN}',  # not JSON
        _big(b"")[:-1] + b',"n":[1,]}',  # a trailing comma in an array
        _big(b"")[:-1] + b',"n":{"a" 1}}',  # no colon
        b"[" + _big(b"") + b"]",  # not an object
        _big(b"") + b"{}",  # trailing bytes
    ],
)
def test_malformed_large_bodies_are_refused_in_msgspecs_words(bad):
    with pytest.raises(msgspec.DecodeError) as whole:
        WHOLE.decode(bad)
    assert scan_members(bad) is None  # the scanner refuses it itself
    with pytest.raises(BadRequest) as e:
        decode_proxy(bad, True)
    assert str(whole.value) in str(e.value)


@pytest.mark.parametrize("inner", [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", "caf\u00e9 \u4e2d\u6587".encode()])
def test_the_utf8_of_strings_is_left_to_the_engine_as_msgspec_leaves_it(inner):
    body = _big(inner)
    WHOLE.decode(body)  # msgspec does not check it in a raw field
    r, compact = decode_proxy_compact(body, True)
    assert compact and inner in bytes(r.messages)


def test_large_bodies_nested_past_the_depth_are_refused_or_taken_as_msgspec_does():
    for depth in (10, 200, 300, 1000):
        deep = b"[" * depth + b"]" * depth
        body = b'{"messages":[{"role":"user","content":"' + b"y" * 4000 + b'"}],"extra":' + deep + b"}"
        try:
            WHOLE.decode(body)
        except RecursionError:
            with pytest.raises(BadRequest, match="nested too deeply"):
                decode_proxy(body, True)
            continue
        assert decode_proxy(body, True).messages


@pytest.mark.parametrize(
    "prompt, error",
    [
        ('"' + "p" * 2000 + '"', None),
        (json.dumps(["a" * 1500, "b"]), None),
        (json.dumps(list(range(600))), None),
        ('""', "`prompt` is required."),
        ("[ ]", "`prompt` is required."),
        ("null", "`prompt` is required."),
        ("5", "Expected `str | array | null`, got `int` - at `$.prompt`"),
        ("-2.5e3", "Expected `str | array | null`, got `float` - at `$.prompt`"),
        ("true", "Expected `str | array | null`, got `bool` - at `$.prompt`"),
        ('{"a": 1}', "Expected `str | array | null`, got `object` - at `$.prompt`"),
    ],
)
@pytest.mark.parametrize("pad", [0, 4000])
def test_completions_prompts_small_and_large(prompt, error, pad):
    body = ('{"model": "m", "prompt": %s, "max_tokens": 3, "x": "%s"}' % (prompt, "z" * pad)).encode()
    if error is None:
        r = decode_proxy(body, False)
        assert json.loads(bytes(r.prompt)) == json.loads(prompt)
    else:
        with pytest.raises(BadRequest) as e:
            decode_proxy(body, False)
        assert error in str(e.value) and e.value.param == "prompt"


@pytest.mark.parametrize("style", ["compact", "spaced", "indented"])
def test_own_fields_are_cut_from_a_large_body_and_the_rest_kept_as_written(style):
    obj = _chat(priority="high", sla_ms=900, temperature=0.70, seed=123456789012345678901234)
    body = _dump(obj, style)
    out = strip_own_fields(body, decode_proxy(body, True))
    kept = {k: v for k, v in obj.items() if k not in ("priority", "sla_ms")}
    assert json.loads(out) == kept
    assert b"123456789012345678901234" in out and b"0.7" in out  # numbers as the client wrote them
    plain = _dump(_chat(temperature=0.5), style)
    assert strip_own_fields(plain, decode_proxy(plain, True)) is plain  # nothing to cut: the same object


def test_the_decoders_cut_is_taken_once_and_is_the_cut_a_fresh_scan_makes():
    body = _dump(_chat(priority="low", sla_ms=900), "spaced")
    r = decode_proxy(body, True)
    first = strip_own_fields(body, r)  # cut by the decoder's scan
    again = strip_own_fields(body, r)  # scanned afresh
    copy = strip_own_fields(bytes(bytearray(body)), r)  # another object, the same bytes
    assert first == again == copy and first is not again
    assert json.loads(first) == {k: v for k, v in json.loads(body).items() if k not in ("priority", "sla_ms")}


def _blocks(body: bytes, chat=True):
    r, compact = decode_proxy_compact(body, chat)
    raw = r.messages if chat else r.prompt
    got = hash_json(raw, HASHER, "m", compact)
    assert got.tolist() == hash_json(raw, HASHER, "m").tolist() == HASHER.hash(json_text(raw), "m").tolist()
    return got.tolist()


def test_the_blocks_do_not_depend_on_how_the_client_spaced_its_json():
    obj = _chat()
    got = [_blocks(_dump(obj, s)) for s in ("compact", "spaced", "indented")]
    assert got[0] == got[1] == got[2] and len(got[0]) > 50


@pytest.mark.parametrize("style", ["compact", "spaced"])
def test_turn_n_plus_one_extends_turn_n(style):
    for turns in (1, 2, 3):
        now = _blocks(_dump(_chat(turns), style))
        nxt = _blocks(_dump(_chat(turns + 1), style))
        assert len(nxt) > len(now) and nxt[: len(now)] == now
    text = "Once upon a time, \"there\" was a gateway.\n" * 60
    for prompt, longer in ((text, text + "And it routed, turn after turn. " * 8), (list(range(700)), list(range(900)))):
        a = _blocks(_dump({"model": "m", "prompt": prompt}, style), chat=False)
        b = _blocks(_dump({"model": "m", "prompt": longer}, style), chat=False)
        assert len(b) > len(a) > 10 and b[: len(a)] == a


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@given(json_values, st.sampled_from([None, 1, 2]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_hash_json_is_json_text_hashed(value, indent, ascii_only):
    text = json.dumps([value, "t" * 130], indent=indent, ensure_ascii=ascii_only).encode()
    compact = json.dumps([value, "t" * 130], separators=(",", ":"), ensure_ascii=ascii_only).encode()
    assert json_text(text) == compact[:-1]
    assert hash_json(text, HASHER, "m").tolist() == HASHER.hash(compact[:-1], "m").tolist()
    assert hash_json(compact, HASHER, "m", True).tolist() == HASHER.hash(compact[:-1], "m").tolist()


# Pieces of string content that the 64-byte chunks of the scanner must get right where
# they straddle a chunk's edge: backslash runs of every length, escaped quotes, \u
# escapes and surrogate pairs (whole, cut, lone), control bytes, plain text.
_PIECES = [
    b"a",
    b"plain text ",
    b"\\",
    b"\\\\",
    b"\\\\\\",
    b'\\"',
    b'\\\\\\"',
    b"\\n",
    b"\\/",
    b"\\u00e9",
    b"\\uD83D\\uDE00",
    b"\\ud83d",
    b"\\ude00",
    b"\\u12",
    b"\\uZZZZ",
    b"\\q",
    b"\x01",
    b"\x1f",
    b"\t",
    b'"',
    b"\xc3\xa9",
    b"x" * 63,
    # escapes the grammar lacks, near the ones it has (the AVX2 walk classifies an
    # escaped byte by its two nibbles): \x \U \B \R \o \| \0, a backslash before UTF-8
    b"\\x",
    b"\\U0041",
    b"\\B",
    b"\\R",
    b"\\o",
    b"\\|",
    b"\\0",
    b"\\\xc3\xa9",
    b"\\b\\f\\r\\t",
]


@given(st.lists(st.sampled_from(_PIECES), max_size=60), st.integers(0, 70), st.sampled_from([b"", b"abc", b"d" * 200]))
@settings(max_examples=2000, deadline=None)
def test_the_scanner_takes_a_string_exactly_when_msgspec_does(pieces, offset, after):
    """Every cut of the content against the 64-byte chunks: the scanner refuses exactly
    the bodies msgspec refuses, and where it takes one, the member ends where it should."""
    content = b"k" * offset + b"".join(pieces) + after
    body = b'{"model":"m","messages":[{"role":"user","content":"' + content + b'"}],"max_tokens":5}'
    ok = _msgspec_takes(body)
    members = scan_members(body)
    assert (members is not None) == ok, (ok, body[:200])
    if ok:
        assert [body[ks:vs].split(b":")[0] for ks, vs, _ in members] == [b'"model"', b'"messages"', b'"max_tokens"']
        assert body[members[2][1] : members[2][2]] == b"5"


@pytest.mark.parametrize("at", [0, 30, 62, 63, 64, 100])
def test_every_byte_after_a_backslash_is_taken_exactly_when_msgspec_takes_it(at):
    # Inside a long string (the 64-byte walk), at each place against a chunk's edge.
    for b in range(256):
        content = b"k" * at + b"\\" + bytes([b]) + b"0041 and more text" * 8
        body = b'{"model":"m","messages":[{"role":"user","content":"' + content + b'"}]}'
        assert (scan_members(body) is not None) == _msgspec_takes(body), (b, at)


def _msgspec_takes(body: bytes) -> bool:
    try:
        WHOLE.decode(body)
    except msgspec.DecodeError:
        return False
    return True
