"""The request scanner digests the prompt's blocks as it validates them (csrc/reqscan.h,
vr_digests), and the router chains those digests into the block hashes instead of
hashing the prompt again (routing/prefix.pyx, BlockDigests). The keys must be exactly
the ones hash_json makes of the same prompt, with every string walk, for every body the
scanner takes, whatever the order of the members, the model (the seed the scanner
guessed or another) or where the blocks fall against the walk's 64-byte chunks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.gateway.requests import decode_proxy_digests, scan_isa
from velocity_fast.routing.prefix import BlockDigests
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings

pytestmark = pytest.mark.timeout(120)

CHAT = {"x-velocity-profile": "chat"}


@pytest.fixture(autouse=True, params=["avx512", "avx2", "sse2"])
def walk(request):
    """Each string walk (the best below where the CPU lacks one); the CPU's choice after."""
    yield scan_isa(request.param)
    scan_isa("auto")


def _keys(router: Router, body: bytes, chat: bool = True, model: str = "m", use_digests: bool = True):
    r, compact, digests = decode_proxy_digests(body, chat)
    info = router.route_info(model, r, CHAT, compact, digests if use_digests else None)
    h = info.hashes
    return h.tolist(), (h.fine, h.coarse, h.tail, h.blocks), digests


def _both(body: bytes, chat: bool = True, model: str = "m"):
    """The keys from the scanner's digests, and from hashing the prompt again."""
    router = Router(RoutingSettings(seed=1, default_profile="chat"))
    fused = _keys(router, body, chat, model)
    again = _keys(router, body, chat, model, use_digests=False)
    return fused, again


def _body(content: str, **extra) -> bytes:
    obj = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}], **extra}
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize("size", [3200, 4095, 4096, 4159, 4160, 5000, 16384, 70000, 262144])
def test_the_digested_keys_are_the_keys_hash_json_makes(size):
    text = ('A "careful" answer, with a café and a line\n. ' * (size // 40 + 1))[: size - 90]
    body = _body(text, model="m", max_tokens=5)
    (keys, shape, digests), (again, shape_again, _) = _both(body)
    assert isinstance(digests, BlockDigests) and len(digests) > 40
    assert keys == again and shape == shape_again
    assert shape[3] == len(digests)  # every block is counted


def test_every_length_of_the_prompt_against_the_blocks_gives_the_same_keys():
    """The prompt's last byte is left out of its blocks: a value whose length is a whole
    number of blocks, or one past, or one short, ends its last block where hashing does."""
    router = Router(RoutingSettings(seed=1, default_profile="chat"))
    lengths = set()
    for pad in range(130):
        body = _body("x" * (4000 + pad), model="m")
        r, compact, digests = decode_proxy_digests(body, True)
        lengths.add(digests.length % 64)
        fused = router.route_info("m", r, CHAT, compact, digests).hashes
        again = router.route_info("m", r, CHAT, compact, None).hashes
        assert fused.tolist() == again.tolist() and fused.blocks == again.blocks, pad
    assert lengths == set(range(64))


@pytest.mark.parametrize("model", ["m", "another-model", ""])
def test_a_model_named_after_the_prompt_and_a_seed_not_guessed_give_the_same_keys(model):
    """The OpenAI SDKs write `messages` before `model`: the scanner cannot know the seed,
    so it chains from the last model's. A different model is chained again from the
    digests; the keys never depend on the guess."""
    router = Router(RoutingSettings(seed=1, default_profile="chat"))
    text = "the same long prompt for every model " * 200
    for m in ("m", model, "m", model):  # guesses right and wrong, in turn
        body = _body(text, model=m)
        fused = _keys(router, body, model=m)
        assert fused[0] == _keys(router, body, model=m, use_digests=False)[0]
    assert _keys(router, _body(text, model="x"), model="x")[0] != _keys(router, _body(text, model="y"), model="y")[0]


def test_a_completions_prompt_is_digested_and_a_spaced_prompt_is_not():
    text = "Once upon a time, a gateway. " * 300
    body = json.dumps({"prompt": text, "model": "m"}, separators=(",", ":")).encode()
    (keys, _, digests), (again, _, _) = _both(body, chat=False)
    assert digests is not None and digests.prompt and keys == again
    # Whitespace between the prompt's tokens: hashed from its compacted text, not digested.
    spaced = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    (keys, _, digests), (again, _, _) = _both(spaced)
    assert digests is None and keys == again and len(keys) > 50
    # Both members: the router hashes messages; the digests are of the first one met.
    both = json.dumps({"prompt": text, "messages": [{"role": "user", "content": text}]}, separators=(",", ":"))
    (keys, _, _), (again, _, _) = _both(both.encode())
    assert keys == again


def test_digests_are_taken_once_and_not_by_another_request():
    router = Router(RoutingSettings(seed=1, default_profile="chat"))
    body = _body("x" * 5000, model="m")
    r, compact, digests = decode_proxy_digests(body, True)
    assert digests is not None
    r2, _, again = decode_proxy_digests(body, True)
    assert again is not None and again is not digests
    small = _body("short", model="m")
    _, _, none = decode_proxy_digests(small, True)  # below the scan's size: none made
    assert none is None
    # Digests of another prompt (a length that is not this one's) are not used for it.
    other = _body("y" * 7000, model="m")
    r3, compact3, _ = decode_proxy_digests(other, True)
    assert (
        router.route_info("m", r3, CHAT, compact3, digests).hashes.tolist()
        == router.route_info("m", r3, CHAT, compact3, None).hashes.tolist()
    )


_PIECES = [
    b"a",
    b"plain text ",
    b"\\\\",
    b'\\"',
    b"\\n",
    b"\\u00e9",
    b"\\uD83D\\uDE00",
    b"\xc3\xa9",
    b"x" * 63,
    b"y" * 64,
]


@given(
    st.lists(st.sampled_from(_PIECES), min_size=40, max_size=400),
    st.integers(0, 130),
    st.booleans(),
    st.sampled_from(["m", "other"]),
)
@settings(max_examples=300, deadline=None)
def test_any_prompt_digests_to_the_keys_hashing_makes(pieces, offset, model_first, model):
    """Every cut of escapes against the walk's chunks and the blocks' edges (offset
    shifts both), the model before or after the prompt."""
    content = b"k" * offset + b"".join(pieces)
    msgs = b'[{"role":"user","content":"' + content + b'"},{"role":"assistant","content":"ok"}]'
    head, tail = (b'{"model":"' + model.encode() + b'",', b"}") if model_first else (b"{", b',"model":"m"}')
    body = head + b'"messages":' + msgs + tail
    (keys, shape, digests), (again, shape_again, _) = _both(body, model=model)
    assert keys == again and shape == shape_again
    if len(body) >= 3072:
        assert digests is not None
