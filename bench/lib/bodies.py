"""The requests the proxy benchmarks send: one small chat request (and its streamed
form), and chat requests of an exact size in KiB."""

from __future__ import annotations

import json
import random

MODEL = "fixed"
BODY = b'{"model":"fixed","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
STREAM_BODY = b'{"model":"fixed","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16,"stream":true}'
PATH = "/v1/chat/completions"
_WORDS = (
    "the",
    "engine",
    "cache",
    "prompt",
    "block",
    "route",
    "token",
    "reply",
    "request",
    "gateway",
    "model",
    "a",
    "of",
    "to",
    "and",
    "is",
    "in",
    "that",
    "with",
    '"quoted"',
    "café",
    "naïve",
    "step",
    "result",
)


def chat_body(kib: int, model: str = MODEL) -> bytes:
    """A chat request of exactly ``kib`` KiB of JSON: a system prompt, then user and
    assistant turns of about 1.5 KiB of text (newlines, quotes, a little non-ASCII: the
    escapes a real history has), ending with a user turn; the same bytes for the same size."""
    rng = random.Random(kib)

    def text(nbytes: int) -> str:
        out, size = [], 0
        while size < nbytes:
            w = rng.choice(_WORDS) + ("\n" if rng.random() < 0.08 else " ")
            out.append(w)
            size += len(w.encode())
        return "".join(out)

    def encode(messages) -> bytes:
        return json.dumps(
            {"model": model, "messages": messages, "max_tokens": 16}, ensure_ascii=False, separators=(",", ":")
        ).encode()

    target = kib * 1024
    messages = [{"role": "system", "content": "You are a careful assistant. Answer briefly.\n"}]
    while len(encode(messages)) + 1600 < target:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text(1500)})
    last = {"role": "user", "content": ""}
    room = target - len(encode(messages + [last]))
    if room < 0:
        raise ValueError(f"a {kib} KiB chat body is too small for its system prompt")
    words = []
    while room > 0:  # ASCII without escapes: one byte of JSON each
        w = rng.choice(_WORDS[:19])[: room - 1] + " " if room > 1 else "x"
        words.append(w)
        room -= len(w)
    last["content"] = "".join(words)
    body = encode(messages + [last])
    assert len(body) == target, (kib, len(body))
    return body
