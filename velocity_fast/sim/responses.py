"""Where generated tokens go: SSE chunks in vLLM's shapes, or one JSON response.

A stream's constant bytes (id, created, model, the JSON around the token text) are
encoded once per request; a token chunk is then three byte strings joined. The step
loop collects chunks and calls ``flush()``, which writes them without awaiting
(``write_nowait``); only a client that reads slowly makes its stream buffer, and the
request's own task drains that buffer.
"""
from __future__ import annotations

import asyncio

import orjson

from velocity_fast.server.connection import Responder

from .tokens import VOCAB_BYTES, render_text

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


class RequestMeta:
    """The constant parts of one request's response."""

    __slots__ = ("id", "created", "model", "chat", "prompt_tokens", "include_usage", "continuous_usage",
                 "details", "seq")

    def __init__(self, id: str, created: int, model: str, chat: bool, prompt_tokens: int,
                 include_usage: bool, continuous_usage: bool, details: bool = False) -> None:
        self.id = id
        self.created = created
        self.model = model
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        # --enable-prompt-tokens-details: the final usage names the prompt tokens the
        # prefix cache served (the sequence's, known once it is scheduled).
        self.details = details
        self.seq = None

    @property
    def cached_tokens(self) -> int:
        seq = self.seq
        return seq.cached_tokens if (self.details and seq is not None) else 0

    def usage(self, completion_tokens: int) -> dict:
        """The ``usage`` object for this many generated tokens (vLLM's member order)."""
        p = self.prompt_tokens
        out = {"prompt_tokens": p, "total_tokens": p + completion_tokens, "completion_tokens": completion_tokens}
        if self.cached_tokens:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


def _usage_bytes(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
    # As vLLM: prompt_tokens_details only in the final usage, and only when the prefix
    # cache served some of the prompt (with --enable-prompt-tokens-details).
    if cached_tokens:
        return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,' \
               b'"prompt_tokens_details":{"cached_tokens":%d}}' % (
                   prompt_tokens, prompt_tokens + completion_tokens, completion_tokens, cached_tokens)
    return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
        prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)


def error_event(status: int, type: str, message: str) -> bytes:
    """vLLM's error inside a started stream, followed by the end of the stream."""
    return b"data: " + orjson.dumps({"error": {"message": message, "type": type, "param": None,
                                               "code": status}}) + b"\n\n" + DONE


class StreamSink:
    """Turns tokens into SSE chunks and writes them to the client."""

    __slots__ = ("resp", "meta", "head", "tail", "tail_open", "generated", "pending", "closing",
                 "backlog", "closed", "waiter", "activity", "keep", "stop_reason")

    def __init__(self, resp: Responder, meta: RequestMeta) -> None:
        self.resp = resp
        self.meta = meta
        model = orjson.dumps(meta.model)
        rid = orjson.dumps(meta.id)
        if meta.chat:
            self.head = (b'data: {"id":' + rid + b',"object":"chat.completion.chunk","created":%d,"model":'
                         % meta.created + model + b',"choices":[{"index":0,"delta":{"content":"')
            self.tail = b'"},"logprobs":null,"finish_reason":null}]'
            self.tail_open = b'"},"logprobs":null,"finish_reason":"%s","stop_reason":null}]'
        else:
            self.head = (b'data: {"id":' + rid + b',"object":"text_completion","created":%d,"model":'
                         % meta.created + model + b',"choices":[{"index":0,"text":"')
            self.tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]'
            self.tail_open = b'","logprobs":null,"finish_reason":"%s","stop_reason":null}]'
        if not meta.continuous_usage:
            self.tail += b"}\n\n"
        self.generated = 0
        self.pending: list[bytes] = []   # chunks of this step loop turn, written by flush()
        self.closing = False
        self.backlog: list[bytes] | None = None
        self.closed = False
        self.waiter: asyncio.Future | None = None
        self.activity = 0
        self.keep = -1               # stop_at: characters of text still to send; -1: all
        self.stop_reason = b"null"

    def stop_at(self, keep: int, stop: str) -> None:
        """The reply ends at a stop string: send its first ``keep`` characters only, as vLLM
        leaves the stop string out, and name it as ``stop_reason``."""
        self.keep = keep
        self.stop_reason = orjson.dumps(stop)
        self.tail_open = self.tail_open.replace(b'"stop_reason":null', b'"stop_reason":' + self.stop_reason)

    def _envelope(self, choices: bytes) -> bytes:
        m = self.meta
        obj = b"chat.completion.chunk" if m.chat else b"text_completion"
        return (b'data: {"id":' + orjson.dumps(m.id) + b',"object":"' + obj + b'","created":%d,"model":'
                % m.created + orjson.dumps(m.model) + b',"choices":' + choices)

    def opening(self) -> bytes:
        """The chunk before the first token: the assistant role (chat only)."""
        if not self.meta.chat:
            return b""
        out = self._envelope(b'[{"index":0,"delta":{"role":"assistant","content":""},'
                             b'"logprobs":null,"finish_reason":null}]')
        if self.meta.continuous_usage:
            out += b',"usage":' + _usage_bytes(self.meta.prompt_tokens, 0)
        return out + b"}\n\n"

    # -- the engine's side -------------------------------------------------------
    def token(self, tok: int, finish_reason: str | None) -> bool:
        """Encode one token's chunk; True when the sink has just got output to flush
        (the engine then remembers it once)."""
        self.generated += 1
        self.activity += 1
        meta = self.meta
        pending = self.pending
        fresh = not pending
        if self.generated == 1 and meta.chat:
            # vLLM sends the role chunk with the first output, not before the prefill.
            pending.append(self.opening())
        text = VOCAB_BYTES[tok]
        if self.keep >= 0:  # a stop string ahead: its text and what follows are held back
            text = text[:self.keep]
            self.keep -= len(text)
            if not text and finish_reason is None:
                return fresh and bool(pending)
        if finish_reason is None:
            if meta.continuous_usage:
                pending.append(self.head + text + self.tail + b',"usage":'
                               + _usage_bytes(meta.prompt_tokens, self.generated) + b"}\n\n")
            else:
                pending.append(self.head + text + self.tail)
            return fresh
        parts = [self.head, text, self.tail_open % finish_reason.encode()]
        if meta.continuous_usage:
            parts += [b',"usage":', _usage_bytes(meta.prompt_tokens, self.generated)]
        parts.append(b"}\n\n")
        if meta.include_usage:
            parts += [self._envelope(b'[],"usage":'),
                      _usage_bytes(meta.prompt_tokens, self.generated, meta.cached_tokens), b"}\n\n"]
        parts.append(DONE)
        pending.append(b"".join(parts))
        self.closing = True
        return fresh

    def fail(self, status: int, type: str, message: str) -> bool:
        """End the stream with vLLM's error event and [DONE]."""
        fresh = not self.pending
        self.pending.append(error_event(status, type, message))
        self.closing = True
        return fresh

    def flush(self) -> None:
        """Write what the step loop produced since the last flush, in one write."""
        pending = self.pending
        if pending:
            self.pending = []
            self._push(pending[0] if len(pending) == 1 else b"".join(pending))
        if self.closing:
            self._close()

    def aborted(self) -> None:
        """The client is gone: drop what is pending and end run()."""
        self.pending = []
        self._close()

    def keep_alive(self) -> None:
        """Send a comment line when nothing was sent since the last call."""
        if self.activity == 0 and not self.closed:
            self._push(KEEP_ALIVE)
        self.activity = 0

    def _push(self, data: bytes) -> None:
        if self.backlog is not None:
            self.backlog.append(data)
            return
        resp = self.resp
        if resp.paused:
            # The client reads slowly: keep the bytes and let the request's task drain.
            self.backlog = [data]
            self._wake()
        else:
            resp.write_nowait(data)

    def _close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    # -- the request's side ------------------------------------------------------
    async def run(self, keep_alive_interval: float | None) -> None:
        """Wait until the stream is over, draining the backlog of a slow client."""
        loop = asyncio.get_running_loop()
        resp = self.resp
        while True:
            if self.backlog:
                data = b"".join(self.backlog)
                self.backlog = []
                await resp.write(data)
                continue
            self.backlog = None
            if self.closed:
                return
            fut = self.waiter = loop.create_future()
            if keep_alive_interval is None:
                await fut
            else:
                done, _ = await asyncio.wait((fut,), timeout=keep_alive_interval)
                if not done:
                    self.waiter = None
                    fut.cancel()
                    self.keep_alive()


class WholeSink:
    """Collects a whole (non-streamed) response."""

    __slots__ = ("meta", "tokens", "finish_reason", "error", "done", "keep", "stop_reason")

    def __init__(self, meta: RequestMeta, done: asyncio.Future) -> None:
        self.meta = meta
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: tuple[int, str, str] | None = None
        self.done = done
        self.keep = -1
        self.stop_reason: str | None = None

    def stop_at(self, keep: int, stop: str) -> None:
        """The reply ends at a stop string: its text is cut before it (StreamSink.stop_at)."""
        self.keep = keep
        self.stop_reason = stop

    def token(self, tok: int, finish_reason: str | None) -> bool:
        """Collect a token; the last one completes the response."""
        self.tokens.append(tok)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self._set()
        return False

    def fail(self, status: int, type: str, message: str) -> bool:
        """The response becomes vLLM's JSON error."""
        self.error = (status, type, message)
        self._set()
        return False

    def flush(self) -> None:
        """Nothing to write before the end."""

    def aborted(self) -> None:
        """The client is gone; the waiting request returns without answering."""
        self._set()

    def _set(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def body(self, system_fingerprint: str) -> dict:
        """The response object in vLLM's shape."""
        m = self.meta
        text = render_text(self.tokens)
        if self.keep >= 0:
            text = text[:self.keep]
        if m.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason,
                      "stop_reason": self.stop_reason}
            obj = "text_completion"
        return {"id": m.id, "object": obj, "created": m.created, "model": m.model, "choices": [choice],
                "system_fingerprint": system_fingerprint, "usage": m.usage(len(self.tokens))}
