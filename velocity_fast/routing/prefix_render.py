"""Canonical bytes of a request's prompt, the input of precise prefix routing's tokenizer;
and (prompt_json, json_text) the JSON text that approximate prefix routing hashes.

Two requests that the engine would see with a common prefix must render with a common
prefix, and the rendering must not depend on JSON key order or whitespace. Chat
messages render one after another, each self-contained, so a conversation's next turn
(the same messages plus new ones) renders as an extension of the previous turn. The
system prompt comes first, as in every chat template, which is what makes a shared
system prompt a shared leading run of blocks.

Rendering never rejects a request: validation is the gateway's job, and anything
unexpected renders as its canonical JSON (or nothing), which only costs affinity.
"""

from __future__ import annotations

import re
import sys
from array import array
from typing import Any

import msgspec
import orjson

__all__ = ["render_prompt", "render_messages", "render_completion_prompt", "prompt_json", "json_text"]

# Field separators (ASCII record / unit separators): they cannot be confused with the
# text of a message, so "ab" + "c" and "a" + "bc" render differently.
_MSG = b"\x1e"
_FIELD = b"\x1f"
_SORTED = orjson.OPT_SORT_KEYS
_BIG_ENDIAN = sys.byteorder == "big"
_raw_json = msgspec.json.Decoder()


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _json(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj, option=_SORTED)
    except TypeError:
        return b""


def _text(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if value is None:
        return b""
    return _json(value)


def _tokens(ids: list) -> bytes:
    """Token ids as 4 little-endian bytes each: 16 tokens fill one 64-byte block, as
    16 tokens fill one vLLM KV block."""
    try:
        packed = array("I", ids)
    except (TypeError, OverflowError, ValueError):
        return _json(ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _content(content: Any, out: bytearray) -> None:
    if isinstance(content, str):
        out += content.encode("utf-8", "surrogatepass")
        return
    if not isinstance(content, list):
        out += _text(content)
        return
    # Content parts: text inline; media by their reference (a data URL is the media
    # itself); anything else by its canonical JSON.
    for part in content:
        kind = _get(part, "type")
        if kind == "text":
            out += _text(_get(part, "text"))
        elif kind == "image_url":
            image = _get(part, "image_url")
            out += b"\x1dimage:" + _text(_get(image, "url") if image is not None else None)
        elif kind == "input_audio":
            audio = _get(part, "input_audio")
            out += b"\x1daudio:" + _text(_get(audio, "data") if audio is not None else None)
        else:
            out += b"\x1d" + _json(part)


def render_messages(messages: list) -> bytes:
    """Chat messages (dicts or objects with role/content/...) as canonical bytes."""
    out = bytearray()
    for m in messages:
        if isinstance(m, msgspec.Raw):  # as the gateway's request decoder leaves them
            m = _raw_json.decode(m)
        out += _MSG
        out += _text(_get(m, "role"))
        name = _get(m, "name")
        if name:
            out += _FIELD + b"name:" + _text(name)
        out += _FIELD
        _content(_get(m, "content"), out)
        tool_calls = _get(m, "tool_calls")
        if tool_calls:
            out += _FIELD + b"tool_calls:" + _json(tool_calls)
        tool_call_id = _get(m, "tool_call_id")
        if tool_call_id:
            out += _FIELD + b"tool_call_id:" + _text(tool_call_id)
    return bytes(out)


def render_completion_prompt(prompt: Any) -> bytes:
    """A completions `prompt`: text, token ids, or a batch of either (the first one
    decides the route: the whole batch goes to one endpoint)."""
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, (bytes, bytearray)):
        return bytes(prompt)
    if isinstance(prompt, list):
        if not prompt:
            return b""
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return _tokens(prompt)
        if isinstance(first, (str, list)):
            return render_completion_prompt(first)
    return _text(prompt)


def render_prompt(body: Any) -> bytes:
    """The canonical prompt bytes of a decoded request body (dict or Struct): chat
    `messages` when present, else the completions / native `prompt`, else nothing."""
    if body is None:
        return b""
    messages = _get(body, "messages")
    if isinstance(messages, msgspec.Raw):  # the gateway's request decoder keeps the array raw
        messages = _raw_json.decode(messages) if messages else None
    if messages:
        return render_messages(messages) if isinstance(messages, list) else _text(messages)
    prompt = _get(body, "prompt")
    if isinstance(prompt, msgspec.Raw):  # kept raw too
        prompt = _raw_json.decode(prompt) if prompt else None
    if prompt is None:
        return b""
    return render_completion_prompt(prompt)


_BETWEEN_TOKENS = re.compile(rb'("(?:[^"\\]|\\.)*")|[ \t\n\r]+', re.S)


def prompt_json(body: Any) -> Any:
    """The JSON value approximate prefix routing hashes for a request body (dict or
    Struct): chat `messages` when present and not empty, else `prompt`; raw values
    (msgspec.Raw, from the gateway's decoder) as they are, decoded ones encoded
    (orjson: compact, as most clients write). b"" when there is neither."""
    if body is None:
        return b""
    for name in ("messages", "prompt"):
        v = _get(body, name)
        if isinstance(v, msgspec.Raw):
            if len(v):
                return v
        elif v is not None and v != [] and v != "":
            try:
                return orjson.dumps(v)
            except TypeError:
                return b""
    return b""


def json_text(value: Any) -> bytes:
    """What blockscan.hash_json hashes of a valid JSON value (bytes or msgspec.Raw): its
    text without the whitespace between tokens, and without its last byte. The Python
    reference of the C, for tests."""
    data = bytes(value)
    return _BETWEEN_TOKENS.sub(lambda m: m.group(1) or b"", data)[:-1]
