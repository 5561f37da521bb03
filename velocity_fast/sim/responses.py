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

from .tokens import VOCAB_BYTES, render_text, token_logprobs

DONE = b"data: [DONE]\n\n"
#: The vLLM version the sim answers as (/version), and its system_fingerprint: the
#: version and a build hash.
VLLM_VERSION = "0.33.0"
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-51a5c5d1"
FINGERPRINT_MEMBER = b',"system_fingerprint":"' + SYSTEM_FINGERPRINT.encode() + b'"'
KEEP_ALIVE = b": keep-alive\n\n"


class RequestMeta:
    """The constant parts of one request's response."""

    __slots__ = (
        "id",
        "created",
        "model",
        "chat",
        "prompt_tokens",
        "include_usage",
        "continuous_usage",
        "details",
        "seq",
    )

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        chat: bool,
        prompt_tokens: int,
        include_usage: bool,
        continuous_usage: bool,
        details: bool = False,
    ) -> None:
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
        return (
            b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
            b'"prompt_tokens_details":{"cached_tokens":%d}}'
            % (prompt_tokens, prompt_tokens + completion_tokens, completion_tokens, cached_tokens)
        )
    return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
        prompt_tokens,
        prompt_tokens + completion_tokens,
        completion_tokens,
    )


def error_event(status: int, type: str, message: str) -> bytes:
    """vLLM's error inside a started stream, followed by the end of the stream."""
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": status}})
        + b"\n\n"
        + DONE
    )


class Choice:
    """The sink of one of a request's ``n`` sequences: its tokens go to the request's
    sink under the choice's index."""

    __slots__ = ("sink", "index")

    def __init__(self, sink: "StreamSink | WholeSink", index: int) -> None:
        self.sink = sink
        self.index = index

    def token(self, tok: int, finish_reason: str | None) -> bool:
        return self.sink.token(tok, finish_reason, self.index)

    def fail(self, status: int, type: str, message: str) -> bool:
        return self.sink.fail(status, type, message)

    def flush(self) -> None:
        self.sink.flush()

    def aborted(self) -> None:
        self.sink.aborted()


def chat_logprobs(tok: int, k: int) -> dict:
    """One token's entry of a chat choice's ``logprobs.content`` (vLLM's shape)."""
    pairs = token_logprobs(tok, k)
    text, lp = pairs[0]
    return {
        "token": text,
        "logprob": lp,
        "bytes": list(text.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in pairs[:k]],
    }


def completion_logprobs(tokens: list[int], k: int, offset: int = 0) -> dict:
    """A completions choice's ``logprobs`` for these tokens (vLLM's shape); ``offset``:
    where the first one starts in the choice's text."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for tok in tokens:
        pairs = token_logprobs(tok, k)
        text, lp = pairs[0]
        out["text_offset"].append(offset)
        out["token_logprobs"].append(lp)
        out["tokens"].append(text)
        out["top_logprobs"].append(dict(pairs))
        offset += len(text)
    return out


class StreamSink:
    """Turns tokens into SSE chunks and writes them to the client."""

    __slots__ = (
        "resp",
        "meta",
        "heads",
        "tail",
        "tail_opens",
        "generated",
        "pending",
        "closing",
        "backlog",
        "closed",
        "waiter",
        "activity",
        "keep",
        "remaining",
        "logprobs",
        "offsets",
    )

    def __init__(self, resp: Responder, meta: RequestMeta, n: int = 1, logprobs: int | None = None) -> None:
        self.resp = resp
        self.meta = meta
        model = orjson.dumps(meta.model)
        rid = orjson.dumps(meta.id)
        if meta.chat:
            head = (
                b'data: {"id":'
                + rid
                + b',"object":"chat.completion.chunk","created":%d,"model":' % meta.created
                + model
                + b',"choices":[{"index":%d,"delta":{"content":"'
            )
            self.tail = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]'
            tail_open = b'"},"logprobs":null,"finish_reason":"%s","stop_reason":null,"token_ids":null}]'
        else:
            head = (
                b'data: {"id":'
                + rid
                + b',"object":"text_completion","created":%d,"model":' % meta.created
                + model
                + b',"choices":[{"index":%d,"text":"'
            )
            self.tail = (
                b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            )
            tail_open = (
                b'","logprobs":null,"finish_reason":"%s","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            )
        # One head per choice index (n > 1: vLLM streams each choice's chunks by index).
        self.heads = [head % i for i in range(n)]
        self.tail_opens = [tail_open] * n
        if not meta.continuous_usage:
            self.tail += b"}\n\n"
        self.generated = 0  # all choices together: what usage counts
        self.remaining = n  # choices not finished yet
        self.logprobs = logprobs  # None, or the top logprobs asked for per token
        self.offsets = [0] * n  # completions: text offset of each choice's next token
        self.pending: list[bytes] = []  # chunks of this step loop turn, written by flush()
        self.closing = False
        self.backlog: list[bytes] | None = None
        self.closed = False
        self.waiter: asyncio.Future | None = None
        self.activity = 0
        self.keep = [-1] * n  # stop_at: characters of text still to send; -1: all

    def stop_at(self, keep: int, stop: str, index: int = 0) -> None:
        """The reply ends at a stop string: send its first ``keep`` characters only, as vLLM
        leaves the stop string out, and name it as ``stop_reason``."""
        self.keep[index] = keep
        self.tail_opens[index] = self.tail_opens[index].replace(
            b'"stop_reason":null', b'"stop_reason":' + orjson.dumps(stop)
        )

    def _envelope(self, choices: bytes) -> bytes:
        m = self.meta
        obj = b"chat.completion.chunk" if m.chat else b"text_completion"
        return (
            b'data: {"id":'
            + orjson.dumps(m.id)
            + b',"object":"'
            + obj
            + b'","created":%d,"model":' % m.created
            + orjson.dumps(m.model)
            + b',"choices":'
            + choices
        )

    def opening(self) -> bytes:
        """The chunks before the first token: the assistant role of each choice (chat only)."""
        if not self.meta.chat:
            return b""
        out = []
        for i in range(len(self.heads)):
            out.append(
                self._envelope(
                    b'[{"index":%d,"delta":{"role":"assistant","content":""},'
                    b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,'
                    b'"prompt_text":null' % i
                )
            )
            if self.meta.continuous_usage:
                out.append(b',"usage":' + _usage_bytes(self.meta.prompt_tokens, 0))
            out.append(b"}\n\n")
        return b"".join(out)

    def _logprobs_json(self, index: int, tok: int) -> bytes:
        k = self.logprobs
        if self.meta.chat:
            return orjson.dumps({"content": [chat_logprobs(tok, k)]})
        off = self.offsets[index]
        self.offsets[index] = off + len(VOCAB_BYTES[tok])
        return orjson.dumps(completion_logprobs([tok], k, off))

    # -- the engine's side -------------------------------------------------------
    def token(self, tok: int, finish_reason: str | None, index: int = 0) -> bool:
        """Encode one token's chunk; True when the sink has just got output to flush
        (the engine then remembers it once)."""
        if self.closing:  # a sibling choice failed the stream: nothing more goes out
            return False
        self.generated += 1
        self.activity += 1
        meta = self.meta
        pending = self.pending
        fresh = not pending
        if self.generated == 1 and meta.chat:
            # vLLM sends the role chunk with the first output, not before the prefill.
            pending.append(self.opening())
        text = VOCAB_BYTES[tok]
        keep = self.keep[index]
        if keep >= 0:  # a stop string ahead: its text and what follows are held back
            text = text[:keep]
            self.keep[index] = keep - len(text)
            if not text and finish_reason is None:
                return fresh and bool(pending)
        tail = self.tail
        if self.logprobs is not None:
            lp = b'"logprobs":' + self._logprobs_json(index, tok)
            tail = tail.replace(b'"logprobs":null', lp)
        head = self.heads[index]
        if finish_reason is None:
            if meta.continuous_usage:
                pending.append(
                    head + text + tail + b',"usage":' + _usage_bytes(meta.prompt_tokens, self.generated) + b"}\n\n"
                )
            else:
                pending.append(head + text + tail)
            return fresh
        tail_open = self.tail_opens[index]
        if self.logprobs is not None:
            tail_open = tail_open.replace(b'"logprobs":null', lp)
        parts = [head, text, tail_open % finish_reason.encode()]
        if meta.continuous_usage:
            parts += [b',"usage":', _usage_bytes(meta.prompt_tokens, self.generated)]
        parts.append(b"}\n\n")
        self.remaining -= 1
        if self.remaining:  # other choices still run
            pending.append(b"".join(parts))
            return fresh
        # vLLM names its build on the stream's last chunk: the usage chunk, else the last
        # choice's finish chunk.
        if meta.include_usage:
            parts += [
                self._envelope(b'[],"usage":'),
                _usage_bytes(meta.prompt_tokens, self.generated, meta.cached_tokens),
                FINGERPRINT_MEMBER,
                b"}\n\n",
            ]
        else:
            parts.insert(len(parts) - 1, FINGERPRINT_MEMBER)
        parts.append(DONE)
        pending.append(b"".join(parts))
        self.closing = True
        return fresh

    def fail(self, status: int, type: str, message: str) -> bool:
        """End the stream with vLLM's error event and [DONE]."""
        if self.closing:
            return False
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

    __slots__ = ("meta", "tokens", "finish_reasons", "error", "done", "keep", "stop_reasons", "remaining", "logprobs")

    def __init__(self, meta: RequestMeta, done: asyncio.Future, n: int = 1, logprobs: int | None = None) -> None:
        self.meta = meta
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.remaining = n
        self.logprobs = logprobs
        self.error: tuple[int, str, str] | None = None
        self.done = done
        self.keep = [-1] * n
        self.stop_reasons: list[str | None] = [None] * n

    def stop_at(self, keep: int, stop: str, index: int = 0) -> None:
        """The reply ends at a stop string: its text is cut before it (StreamSink.stop_at)."""
        self.keep[index] = keep
        self.stop_reasons[index] = stop

    def token(self, tok: int, finish_reason: str | None, index: int = 0) -> bool:
        """Collect a token; the last one of the last choice completes the response."""
        self.tokens[index].append(tok)
        if finish_reason is not None:
            self.finish_reasons[index] = finish_reason
            self.remaining -= 1
            if not self.remaining:
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
        k = self.logprobs
        choices = []
        for i, tokens in enumerate(self.tokens):
            text = render_text(tokens)
            if self.keep[i] >= 0:
                text = text[: self.keep[i]]
            # vLLM 0.32's members, in its order, with the nulls it writes for what is off.
            if m.chat:
                lp = None if k is None else {"content": [chat_logprobs(t, k) for t in tokens]}
                choices.append(
                    {
                        "index": i,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": lp,
                        "finish_reason": self.finish_reasons[i],
                        "stop_reason": self.stop_reasons[i],
                        "token_ids": None,
                        "routed_experts": None,
                    }
                )
            else:
                lp = None if k is None else completion_logprobs(tokens, k)
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": self.finish_reasons[i],
                        "stop_reason": self.stop_reasons[i],
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
        obj = "chat.completion" if m.chat else "text_completion"
        usage = m.usage(sum(len(t) for t in self.tokens))
        usage.setdefault("prompt_tokens_details", None)
        usage["completion_tokens_details"] = None
        out = {
            "id": m.id,
            "object": obj,
            "created": m.created,
            "model": m.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": system_fingerprint,
            "usage": usage,
        }
        if m.chat:
            out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return out
