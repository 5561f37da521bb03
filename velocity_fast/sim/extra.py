"""The sim engine's other vLLM routes: /v1/embeddings, /detokenize, GET /v1/models/{id},
and the generation routes of the Responses API (/v1/responses) and Anthropic's Messages
API (/v1/messages), minimal but in vLLM's shapes, whole and streamed, run by the same
engine (batch, KV cache, metrics) as chat.

Kept apart from api.py: these routes share its engine and tokenizer, not its code.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
import time

import msgspec
import orjson

from velocity_fast.http.message import Request
from velocity_fast.server.connection import Responder

from .engine import Sequence
from .schema import Message, message_texts, render_chat
from .tokens import VOCAB, block_hashes, count_tokens, pseudo_token_ids, render_text, request_rng, token_block_hashes

__all__ = ["extra_routes", "MODEL_PREFIX"]

#: GET /v1/models/{id}: the path's prefix (the id may hold slashes: org/name).
MODEL_PREFIX = "/v1/models/"

_EMBED_DIM = 32


class EmbeddingRequest(msgspec.Struct):
    input: str | list  # a string, strings, token ids, or lists of them
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class ResponsesRequest(msgspec.Struct):
    input: str | list[dict]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    user: str | None = None


class MessagesRequest(msgspec.Struct):
    model: str
    messages: list[dict]
    max_tokens: int
    system: str | list[dict] | None = None
    stream: bool = False


_embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
_responses_decoder = msgspec.json.Decoder(ResponsesRequest)
_messages_decoder = msgspec.json.Decoder(MessagesRequest)


def _text_of(content) -> str:
    """A message's content: a string, or the text of its parts (input_text, text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _vector(data: bytes, dim: int) -> list[float]:
    """A deterministic unit vector for ``data``: the same text, the same embedding."""
    raw = b""
    i = 0
    while len(raw) < 4 * dim:
        raw += hashlib.blake2b(data, digest_size=64, salt=i.to_bytes(16, "little")).digest()
        i += 1
    v = [x / 2147483648.0 for x in struct.unpack(f"<{dim}i", raw[: 4 * dim])]
    norm = sum(x * x for x in v) ** 0.5 or 1.0
    return [round(x / norm, 6) for x in v]


class _EventSink:
    """A sequence's tokens as they come, for a route that writes its own events."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def token(self, tok: int, finish_reason: str | None) -> bool:
        self.queue.put_nowait(("token", tok, finish_reason))
        return False

    def fail(self, status: int, type: str, message: str) -> bool:
        self.queue.put_nowait(("fail", status, (type, message)))
        return False

    def flush(self) -> None:
        """Each token is written as it comes."""

    def aborted(self) -> None:
        self.queue.put_nowait(("aborted", None, None))


def _sse(event: str, obj: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class ExtraRoutes:
    """The routes above, for one SimAPI (its config, engine and tokenizer)."""

    def __init__(self, api) -> None:
        self.api = api

    def routes(self) -> dict:
        return {
            "/v1/embeddings": (("POST",), self._embeddings),
            "/detokenize": (("POST",), self._detokenize),
            "/v1/responses": (("POST",), self._responses),
            "/v1/messages": (("POST",), self._messages),
        }

    # -- relayed routes ------------------------------------------------------------
    async def model(self, req: Request, resp: Responder) -> None:
        """GET /v1/models/{id}: vLLM 0.32 serves no such route, and answers it as any path it
        does not know (the gateway answers it from its own model list)."""
        resp.send_json(404, {"detail": "Not Found"})

    def _model_ok(self, model: str | None, resp: Responder) -> bool:
        if model and model != self.api.cfg.model:
            resp.send_error(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model")
            return False
        return True

    def _bad(self, resp: Responder, e: Exception) -> None:
        resp.send_error(400, str(e), type="BadRequestError")

    async def _embeddings(self, req: Request, resp: Responder) -> None:
        try:
            body = _embedding_decoder.decode(req.body)
            if not body.input:
                raise ValueError("Input cannot be empty.")
            if body.dimensions is not None and not 1 <= body.dimensions <= _EMBED_DIM:
                raise ValueError(f"dimensions must be between 1 and {_EMBED_DIM}, got {body.dimensions}.")
            if body.encoding_format not in ("float", "base64"):
                raise ValueError(f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}.")
        except (msgspec.DecodeError, ValueError) as e:
            return self._bad(resp, e)
        if not self._model_ok(body.model, resp):
            return
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        dim = body.dimensions or _EMBED_DIM
        data, tokens = [], 0
        for i, item in enumerate(inputs):
            raw = item.encode() if isinstance(item, str) else orjson.dumps(item)
            tokens += len(item) if isinstance(item, list) else count_tokens(raw)
            vec = _vector(raw, dim)
            if body.encoding_format == "base64":  # as vLLM: little-endian float32, base64
                vec = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode()
            data.append({"index": i, "object": "embedding", "embedding": vec})
        resp.send_json(
            200,
            {
                "id": f"embd-{os.urandom(16).hex()}",
                "object": "list",
                "created": int(time.time()),
                "model": self.api.cfg.model,
                "data": data,
                "usage": {
                    "prompt_tokens": tokens,
                    "total_tokens": tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            },
        )

    async def _detokenize(self, req: Request, resp: Responder) -> None:
        try:
            body = _detokenize_decoder.decode(req.body)
        except msgspec.DecodeError as e:
            return self._bad(resp, e)
        if not self._model_ok(body.model, resp):
            return
        tok = self.api.tokenizer
        if tok is not None:
            text = tok.decode(body.tokens)
        else:
            # The byte model's ids are one-way (a hash of four bytes): an id reads as the
            # word the sim generates for it, as its completions do.
            text = render_text([t % len(VOCAB) for t in body.tokens])
        resp.send_json(200, {"prompt": text})

    # -- generation ----------------------------------------------------------------
    def _plan(self, prompt: bytes, ids: list[int] | None, max_tokens: int | None, sink) -> Sequence:
        """A sequence for ``prompt`` as chat's are planned: max_tokens, else an EOS of its own."""
        cfg = self.api.cfg
        prompt_tokens = count_tokens(prompt) if ids is None else max(1, len(ids))
        if prompt_tokens >= cfg.max_model_len or (
            max_tokens is not None and prompt_tokens + max_tokens > cfg.max_model_len
        ):
            raise ValueError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + (max_tokens or 0)} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        rng = request_rng(cfg.seed, prompt)
        if max_tokens is not None and not cfg.natural_stop:
            target, finish = max_tokens, "length"
        else:
            cap = cfg.max_model_len - prompt_tokens
            if max_tokens is not None:
                cap = min(cap, max_tokens)
            natural = 1 + int(rng.expovariate(1.0 / max(1, cfg.natural_output_mean)))
            target, finish = (natural, "stop") if natural < cap else (cap, "length")
        seed = cfg.model.encode()  # (as api.py's block hashes: seeded by the model name)
        if not cfg.enable_prefix_caching:
            hashes = []
        elif ids is not None:
            hashes = token_block_hashes(ids, cfg.block_size, seed)
        else:
            hashes = block_hashes(prompt, cfg.block_size, seed)
        kv_ids = None if self.api.engine.publisher is None else (ids or pseudo_token_ids(prompt))
        return Sequence(prompt_tokens, hashes, target, finish, rng, sink, None, kv_ids)

    def _chat_prompt(self, pairs: list[tuple[str, str]]) -> tuple[bytes, list[int] | None]:
        msgs = [Message(role=r, content=c) for r, c in pairs]
        tok = self.api.tokenizer
        return render_chat(msgs), (tok.encode_chat(message_texts(msgs)) if tok is not None else None)

    async def _run(
        self, req: Request, resp: Responder, seq: Sequence, sink: _EventSink, on_token, on_end, on_fail
    ) -> None:
        """Feed the sequence's tokens to ``on_token(text)``, then ``on_end(n, finish)``
        (or ``on_fail(status, type, message)``); the client leaving aborts it."""
        engine = self.api.engine
        resp.add_disconnect_callback(lambda: engine.abort(seq))
        engine.submit(seq)
        n = 0
        while True:
            kind, a, b = await sink.queue.get()
            if kind == "aborted":
                return
            if kind == "fail":
                return on_fail(a, b[0], b[1])
            n += 1
            on_token(render_text([a]))
            if b is not None:
                return on_end(n, b)

    async def _responses(self, req: Request, resp: Responder) -> None:
        api = self.api
        try:
            body = _responses_decoder.decode(req.body)
            if body.max_output_tokens is not None and body.max_output_tokens < 1:
                raise ValueError(f"max_output_tokens must be at least 1, got {body.max_output_tokens}.")
            pairs = [("system", body.instructions)] if body.instructions else []
            if isinstance(body.input, str):
                pairs.append(("user", body.input))
            else:
                pairs += [(str(i.get("role", "user")), _text_of(i.get("content"))) for i in body.input]
            if not pairs:
                raise ValueError("input must not be empty.")
            prompt, ids = self._chat_prompt(pairs)
        except (msgspec.DecodeError, ValueError) as e:
            return self._bad(resp, e)
        if not self._model_ok(body.model, resp):
            return
        sink = _EventSink()
        try:
            seq = self._plan(prompt, ids, body.max_output_tokens, sink)
        except ValueError as e:
            return self._bad(resp, e)
        created = int(time.time())
        rid, mid = f"resp_{os.urandom(16).hex()}", f"msg_{os.urandom(16).hex()}"
        parts: list[str] = []

        def response(status: str, n: int | None, finish: str | None = None) -> dict:
            # vLLM 0.32's members and order; a reply cut by max_output_tokens is "incomplete".
            text = "".join(parts)
            incomplete = None
            if status == "completed" and finish == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            out = {
                "id": rid,
                "created_at": created,
                "incomplete_details": incomplete,
                "instructions": body.instructions,
                "metadata": None,
                "model": api.cfg.model,
                "object": "response",
                "output": []
                if status == "in_progress"
                else [
                    {
                        "id": mid,
                        "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
                        "role": "assistant",
                        "status": "completed",
                        "type": "message",
                        "phase": None,
                    }
                ],
                "parallel_tool_calls": True,
                "temperature": 1.0,
                "tool_choice": "none",
                "tools": [],
                "top_p": 1.0,
                "background": False,
                "max_output_tokens": body.max_output_tokens,
                "max_tool_calls": None,
                "previous_response_id": None,
                "prompt": None,
                "reasoning": None,
                "service_tier": "auto",
                "status": status,
                "text": None,
                "top_logprobs": None,
                "truncation": "disabled",
                "usage": None,
                "user": body.user,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "input_messages": None,
                "output_messages": None,
            }
            if n is not None:
                out["usage"] = {
                    "input_tokens": seq.prompt_tokens,
                    "input_tokens_details": {
                        "cached_tokens": seq.cached_tokens,
                        "cache_write_tokens": 0,
                        "input_tokens_per_turn": [],
                        "cached_tokens_per_turn": [],
                    },
                    "output_tokens": n,
                    "output_tokens_details": {
                        "reasoning_tokens": 0,
                        "tool_output_tokens": 0,
                        "output_tokens_per_turn": [],
                        "tool_output_tokens_per_turn": [],
                    },
                    "total_tokens": seq.prompt_tokens + n,
                }
            return out

        if not body.stream:
            result: list = []
            await self._run(
                req,
                resp,
                seq,
                sink,
                parts.append,
                lambda n, f: result.append(("ok", n, f)),
                lambda s, t, m: result.append((s, t, m)),
            )
            if resp.disconnected or not result:
                return
            if result[0][0] != "ok":
                return resp.send_error(result[0][0], result[0][2], type=result[0][1])
            return resp.send_json(200, response("completed", result[0][1], result[0][2]))
        resp.start(200, content_type="text/event-stream")
        n_seq = [0]

        def ev(kind: str, **fields) -> None:
            n_seq[0] += 1
            resp.write_nowait(_sse(kind, {"type": kind, "sequence_number": n_seq[0] - 1, **fields}))

        item = {
            "id": mid,
            "content": [],
            "role": "assistant",
            "status": "in_progress",
            "type": "message",
            "phase": None,
        }
        ev("response.created", response=response("in_progress", None))
        ev("response.in_progress", response=response("in_progress", None))
        ev("response.output_item.added", item=item, output_index=0)
        ev(
            "response.content_part.added",
            item_id=mid,
            output_index=0,
            content_index=0,
            part={"annotations": [], "text": "", "type": "output_text", "logprobs": []},
        )

        def token(text: str) -> None:
            parts.append(text)
            ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=text, logprobs=[])

        def end(n: int, finish: str) -> None:
            text = "".join(parts)
            ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text, logprobs=[])
            ev(
                "response.content_part.done",
                item_id=mid,
                output_index=0,
                content_index=0,
                part={"annotations": [], "text": text, "type": "output_text", "logprobs": None},
            )
            done = response("completed", n, finish)
            ev("response.output_item.done", item=done["output"][0], output_index=0)
            ev("response.completed", response=done)

        def fail(status: int, type: str, message: str) -> None:
            ev("error", code=type, message=message, param=None)

        await self._run(req, resp, seq, sink, token, end, fail)
        if not resp.disconnected:
            resp.end()

    async def _messages(self, req: Request, resp: Responder) -> None:
        api = self.api

        def error(status: int, message: str, kind: str = "invalid_request_error") -> None:
            # Anthropic's error shape, as vLLM's /v1/messages answers.
            resp.send_json(status, {"type": "error", "error": {"type": kind, "message": message}})

        try:
            body = _messages_decoder.decode(req.body)
            if body.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {body.max_tokens}.")
            if not body.messages:
                raise ValueError("messages must be a non-empty list.")
            pairs = [("system", _text_of(body.system))] if body.system else []
            pairs += [(str(m.get("role", "user")), _text_of(m.get("content"))) for m in body.messages]
            prompt, ids = self._chat_prompt(pairs)
        except (msgspec.DecodeError, ValueError) as e:
            return error(400, str(e))
        if body.model != api.cfg.model:
            return error(404, f"The model `{body.model}` does not exist.", "not_found_error")
        sink = _EventSink()
        try:
            seq = self._plan(prompt, ids, body.max_tokens, sink)
        except ValueError as e:
            return error(400, str(e))
        mid = f"msg_{os.urandom(12).hex()}"
        parts: list[str] = []

        def stop(finish: str) -> str:
            return "max_tokens" if finish == "length" else "end_turn"

        if not body.stream:
            result: list = []
            await self._run(
                req,
                resp,
                seq,
                sink,
                parts.append,
                lambda n, f: result.append((n, f)),
                lambda s, t, m: result.append((s, t, m)),
            )
            if resp.disconnected or not result:
                return
            if len(result[0]) == 3:
                return error(result[0][0], result[0][2], "api_error")
            n, finish = result[0]
            return resp.send_json(
                200,
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "text", "text": "".join(parts)}],
                    "model": api.cfg.model,
                    "stop_reason": stop(finish),
                    "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": n},
                },
            )
        resp.start(200, content_type="text/event-stream")

        def ev(kind: str, **fields) -> None:
            resp.write_nowait(_sse(kind, {"type": kind, **fields}))

        ev(
            "message_start",
            message={
                "id": mid,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": api.cfg.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": 0},
            },
        )
        ev("content_block_start", index=0, content_block={"type": "text", "text": ""})

        def token(text: str) -> None:
            ev("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

        def end(n: int, finish: str) -> None:
            ev("content_block_stop", index=0)
            ev(
                "message_delta",
                delta={"stop_reason": stop(finish), "stop_sequence": None},
                usage={"input_tokens": seq.prompt_tokens, "output_tokens": n},
            )
            ev("message_stop")

        def fail(status: int, type: str, message: str) -> None:
            ev("error", error={"type": "api_error", "message": message})

        await self._run(req, resp, seq, sink, token, end, fail)
        if not resp.disconnected:
            resp.end()


def extra_routes(api) -> tuple[dict, object]:
    """The routes to add to a SimAPI's table, and the handler of GET /v1/models/{id}."""
    extra = ExtraRoutes(api)
    return extra.routes(), extra.model
