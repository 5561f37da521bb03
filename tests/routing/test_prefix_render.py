"""Canonical prompt rendering for prefix hashing (velocity_fast/routing/prefix_render.py)."""

import msgspec
import orjson

from velocity_fast.gateway.requests import decode_proxy
from velocity_fast.routing.prefix_render import render_prompt

SYS = {"role": "system", "content": "Be brief."}


def test_a_conversation_turn_renders_as_an_extension_of_the_previous_turn():
    turn1 = [SYS, {"role": "user", "content": "Hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}]
    a = render_prompt({"messages": turn1})
    b = render_prompt({"messages": turn2})
    assert b.startswith(a) and len(b) > len(a)


def test_key_order_and_whitespace_of_the_json_do_not_matter():
    one = b'{"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"u","detail":"low"}}]}]}'
    two = b'{ "messages": [ { "content": [ {"text": "x", "type": "text"}, {"image_url": {"detail": "low", "url": "u"}, "type": "image_url"} ], "role": "user" } ] }'
    assert render_prompt(orjson.loads(one)) == render_prompt(orjson.loads(two))


def test_text_parts_render_like_plain_content_and_media_by_reference():
    plain = render_prompt({"messages": [{"role": "user", "content": "hello"}]})
    parts = render_prompt({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    assert plain == parts
    img1 = render_prompt(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ]
        }
    )
    img2 = render_prompt(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}]}
            ]
        }
    )
    assert img1 != img2 and b"AAAA" in img1


def test_roles_and_message_boundaries_are_part_of_the_rendering():
    a = render_prompt({"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]})
    b = render_prompt({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]})
    c = render_prompt({"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "c"}]})
    assert len({a, b, c}) == 3


def test_tool_calls_and_names_are_rendered():
    base = {"role": "assistant", "content": None}
    with_call = dict(base, tool_calls=[{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    assert render_prompt({"messages": [base]}) != render_prompt({"messages": [with_call]})
    named = render_prompt({"messages": [{"role": "user", "name": "ann", "content": "x"}]})
    assert b"ann" in named


def test_completion_prompts_text_tokens_and_batches():
    assert render_prompt({"prompt": "héllo"}) == "héllo".encode()
    toks = render_prompt({"prompt": [1, 2, 258]})
    assert toks == b"\x01\x00\x00\x00\x02\x00\x00\x00\x02\x01\x00\x00"  # 4 bytes a token
    assert render_prompt({"prompt": ["first", "second"]}) == b"first"
    assert render_prompt({"prompt": [[5, 6], [7]]}) == render_prompt({"prompt": [5, 6]})
    assert render_prompt({"prompt": []}) == b""


def test_decoded_structs_render_like_dicts():
    class Req(msgspec.Struct):
        model: str | None = None
        messages: list | None = None
        prompt: str | list | None = None

    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    assert render_prompt(msgspec.json.decode(body, type=Req)) == render_prompt(orjson.loads(body))
    assert render_prompt(Req(prompt="abc")) == b"abc"


def test_the_gateways_request_with_raw_messages_renders_like_the_decoded_body():
    # The gateway keeps each message as raw JSON (ProxyRequest): the rendering, and so the
    # route, must not change for it, key order and spacing included.
    body = (
        b'{"model":"m","messages":[{"role":"system","content":"be brief"},'
        b'{ "content" : [{"type":"text","text":"hi"}], "role":"user", "name":"ann"}]}'
    )
    r = decode_proxy(body, chat=True)
    assert render_prompt(r) == render_prompt(orjson.loads(body)) != b""


def test_odd_input_renders_without_raising():
    for body in [
        None,
        {},
        {"messages": "not a list"},
        {"messages": [{"content": 5}]},
        {"prompt": 12},
        {"prompt": [-1, 2]},
        {"prompt": [True]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}, {"x": object()}]}]},
    ]:
        assert isinstance(render_prompt(body), bytes)
