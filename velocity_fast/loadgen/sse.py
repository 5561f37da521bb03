"""Token timing from an OpenAI/vLLM server-sent-event stream.

A token event is a ``data:`` event whose first choice carries non-empty text
(``delta.content`` for chat, ``text`` for completions); the role chunk and the
usage chunk are not tokens, which matches how vLLM's own benchmark takes TTFT
("first chunk with content"). Events of another shape (the native ``/generate``
stream) count as tokens unless they carry ``error``. ``data: {"error": ...}``
marks the stream failed, as vLLM reports errors after the stream began.
"""

from __future__ import annotations

import orjson


class SSETokenTimer:
    """Feed raw body bytes with their arrival time; read token timings afterwards."""

    __slots__ = ("_buf", "first_token_at", "last_token_at", "gaps", "tokens", "usage_tokens", "error", "done")

    def __init__(self) -> None:
        self._buf = b""
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.gaps: list[float] = []
        self.tokens = 0
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        """Consume ``data`` (any split of the stream) received at ``now``."""
        buf = self._buf + data if self._buf else data
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now)
        self._buf = buf[start:]

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = self.error or "malformed SSE event"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        choices = obj.get("choices")
        if choices is None:
            self._token(now)
            return
        if not choices:
            return
        c = choices[0]
        delta = c.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else c.get("text")
        if text:
            self._token(now)

    def _token(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now
        self.tokens += 1
