"""The sim engine's HTTP surface: vLLM's OpenAI routes, /health, /metrics and friends.

Every answer follows VLLM_CONTRACT.md: routes, error shapes and messages, SSE chunks,
auth on /v1/ paths only.
"""
from __future__ import annotations

import asyncio
import os
import time

import msgspec
import orjson

from velocity_fast.http.message import Request
from velocity_fast.server.connection import Responder
from velocity_fast.sim.errors import BadRequest

from .settings import SimConfig
from .engine import Engine, Sequence
from .extra import MODEL_PREFIX, extra_routes
from .responses import RequestMeta, StreamSink, WholeSink
from .schema import (ChatRequest, CompletionRequest, chat_decoder, completion_decoder, message_texts,
                     render_chat, render_prompt, tokenize_decoder)
from .tokens import (TextTokenizer, block_hashes, count_tokens, pseudo_token_ids, request_rng,
                     token_block_hashes)

#: The vLLM version the sim engine presents itself as (VLLM_CONTRACT.md).
VLLM_VERSION = "0.33.0"
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-51a5c5d1"

_NOT_FOUND = b'{"detail":"Not Found"}'
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimAPI:
    """Routes requests to the engine; ``handle`` is the HTTPServer handler."""

    def __init__(self, cfg: SimConfig, engine: Engine, tokenizer: TextTokenizer | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self._auth = f"Bearer {cfg.api_key}" if cfg.api_key else None
        self._keep_alive = (cfg.sse_keep_alive_interval / cfg.time_scale
                            if cfg.sse_keep_alive_interval else None)
        self._hash_seed = cfg.model.encode()
        self._routes = {
            "/v1/chat/completions": (("POST",), self._chat),
            "/v1/completions": (("POST",), self._completions),
            "/v1/models": (("GET",), self._models),
            "/health": (("GET",), self._health),
            "/ping": (("GET", "POST"), self._health),
            "/metrics": (("GET",), self._metrics),
            "/version": (("GET",), self._version),
            "/tokenize": (("POST",), self._tokenize),
            "/reset_prefix_cache": (("POST",), self._reset_prefix_cache),
        }
        # /v1/embeddings, /detokenize, /v1/responses, /v1/messages, GET /v1/models/{id}: sim/extra.py.
        extra, self._model_by_id = extra_routes(self)
        self._routes.update(extra)

    async def handle(self, req: Request, resp: Responder) -> None:
        """Dispatch one request."""
        route = self._routes.get(req.path)
        if route is None and req.path.startswith(MODEL_PREFIX) and req.method == "GET":
            route = (("GET",), self._model_by_id)
        if route is None:
            resp.send(404, _NOT_FOUND)
            return
        methods, fn = route
        if req.method not in methods:
            resp.send(405, _NOT_ALLOWED)
            return
        if self._auth is not None and req.path.startswith("/v1/") and req.headers.get("authorization") != self._auth:
            resp.send(401, _UNAUTHORIZED)
            return
        await fn(req, resp)

    # -- small routes --------------------------------------------------------------
    async def _health(self, req: Request, resp: Responder) -> None:
        resp.send(200, b"", content_type=None)

    async def _metrics(self, req: Request, resp: Responder) -> None:
        resp.send(200, self.engine.metrics.render(), content_type=_METRICS_TYPE)

    async def _version(self, req: Request, resp: Responder) -> None:
        resp.send_json(200, {"version": VLLM_VERSION})

    async def _models(self, req: Request, resp: Responder) -> None:
        cfg = self.cfg
        resp.send_json(200, {"object": "list", "data": [{
            "id": cfg.model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": cfg.root or cfg.model, "parent": None, "max_model_len": cfg.max_model_len,
            "permission": [{
                "id": f"modelperm-{self.created:x}", "object": "model_permission", "created": self.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False}],
        }]})

    async def _tokenize(self, req: Request, resp: Responder) -> None:
        try:
            body = tokenize_decoder.decode(req.body)
            if body.messages is not None:
                data = render_chat(body.messages)
            else:
                data = render_prompt(body.prompt)
        except (msgspec.DecodeError, ValueError) as e:
            resp.send_error(400, str(e), type="BadRequestError")
            return
        if not self._model_ok(body.model, resp):
            return
        if self.tokenizer is not None:
            ids = (self.tokenizer.encode_chat(message_texts(body.messages)) if body.messages is not None
                   else self._prompt_ids(body.prompt))
        else:
            # Pseudo token ids from the bytes they stand for: stable for the same text.
            ids = pseudo_token_ids(data)
        resp.send_json(200, {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def _reset_prefix_cache(self, req: Request, resp: Responder) -> None:
        # vLLM's dev-mode route: ?reset_running_requests=true preempts what runs first.
        running = "reset_running_requests=true" in (req.query or "").lower()
        if self.engine.reset_prefix_cache(running):
            resp.send(200, b"", content_type=None)
            return
        resp.send_error(409, f"Failed to reset prefix cache: {self.engine.kv.used} blocks are in use by running "
                             "requests (pass reset_running_requests=true to preempt them).", type="ConflictError")

    def _prompt_ids(self, prompt: str | list | None) -> list[int]:
        """A completions prompt as the tokenizer's ids (token ids pass as they are)."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return self.tokenizer.encode(render_prompt(prompt).decode(errors="replace"), add_special_tokens=True)

    # -- generation --------------------------------------------------------------------
    async def _chat(self, req: Request, resp: Responder) -> None:
        try:
            body = chat_decoder.decode(req.body)
            if not body.messages:
                raise BadRequest("Field required: messages must be a non-empty list.")
            prompt = render_chat(body.messages)
            ids = self.tokenizer.encode_chat(message_texts(body.messages)) if self.tokenizer is not None else None
        except (msgspec.DecodeError, BadRequest, ValueError) as e:
            resp.send_error(400, str(e), type="BadRequestError")
            return
        mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        await self._generate(req, resp, body, prompt, mt, chat=True, ids=ids)

    async def _completions(self, req: Request, resp: Responder) -> None:
        try:
            body = completion_decoder.decode(req.body)
            prompt = render_prompt(body.prompt)
            ids = self._prompt_ids(body.prompt) if self.tokenizer is not None else None
        except (msgspec.DecodeError, ValueError) as e:
            resp.send_error(400, str(e), type="BadRequestError")
            return
        await self._generate(req, resp, body, prompt, body.max_tokens, chat=False, ids=ids)

    def _model_ok(self, model: str | None, resp: Responder) -> bool:
        cfg = self.cfg
        if model and model != cfg.model:
            resp.send_error(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model")
            return False
        return True

    def _validate(self, body: ChatRequest | CompletionRequest, prompt_tokens: int, max_tokens: int | None) -> None:
        cfg = self.cfg
        if body.stream_options is not None and not body.stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        if body.priority != 0:
            raise BadRequest(f"Got priority {body.priority} but Priority scheduling is not enabled.")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.")
        if prompt_tokens >= cfg.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the input messages.")
        if max_tokens is not None and prompt_tokens + max_tokens > cfg.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.")

    async def _generate(self, req: Request, resp: Responder, body: ChatRequest | CompletionRequest,
                        prompt: bytes, max_tokens: int | None, *, chat: bool, ids: list[int] | None = None) -> None:
        cfg = self.cfg
        if not self._model_ok(body.model, resp):
            return
        prompt_tokens = count_tokens(prompt) if ids is None else max(1, len(ids))
        try:
            self._validate(body, prompt_tokens, max_tokens)
        except BadRequest as e:
            resp.send_error(400, str(e), type="BadRequestError")
            return
        rng = request_rng(cfg.seed, prompt)
        if max_tokens is not None and not (cfg.natural_stop and not body.ignore_eos):
            target, finish = max_tokens, "length"
        else:
            # No limit asked: the reply ends by itself (EOS) unless ignore_eos, and
            # never runs past the context window.
            cap = cfg.max_model_len - prompt_tokens
            natural = 1 + int(rng.expovariate(1.0 / max(1, cfg.natural_output_mean)))
            if max_tokens is not None:  # --natural-stop: ends by itself, or at max_tokens
                cap = min(cap, max_tokens)
            if body.ignore_eos or natural >= cap:
                target, finish = cap, "length"
            else:
                target, finish = natural, "stop"
        failure = self.engine.plan_failure(target)
        if failure is not None and failure.at == 0:
            resp.send_error(failure.status, failure.message, type=failure.type)
            return
        xid = req.headers.get("x-request-id")
        rid = (("chatcmpl-" if chat else "cmpl-") + (xid if xid else os.urandom(16).hex()))
        so = body.stream_options
        # As vLLM: per-chunk usage only when usage was asked for at all.
        include_usage = bool(so and so.include_usage)
        meta = RequestMeta(rid, int(time.time()), cfg.model, chat, prompt_tokens, include_usage,
                           include_usage and bool(so.continuous_usage_stats), cfg.enable_prompt_tokens_details)
        if not cfg.enable_prefix_caching:
            hashes = []
        elif ids is not None:
            hashes = token_block_hashes(ids, cfg.block_size, self._hash_seed)
        else:
            hashes = block_hashes(prompt, cfg.block_size, self._hash_seed)
        # KV events carry the prompt's token ids: the tokenizer's, else the byte model's.
        if self.engine.publisher is None:
            ids = None
        elif ids is None:
            ids = pseudo_token_ids(prompt)
        headers = (("x-request-id", xid),) if xid else ()
        engine = self.engine
        if body.stream:
            sink = StreamSink(resp, meta)
            seq = meta.seq = Sequence(prompt_tokens, hashes, target, finish, rng, sink, failure, ids)
            resp.start(200, headers=headers)
            resp.add_disconnect_callback(lambda: engine.abort(seq))
            engine.submit(seq)
            await sink.run(self._keep_alive)
            resp.end()
            return
        done = asyncio.get_running_loop().create_future()
        whole = WholeSink(meta, done)
        seq = meta.seq = Sequence(prompt_tokens, hashes, target, finish, rng, whole, failure, ids)
        resp.add_disconnect_callback(lambda: engine.abort(seq))
        engine.submit(seq)
        await done
        if resp.disconnected:
            return
        if whole.error is not None:
            status, type, message = whole.error
            resp.send_error(status, message, type=type, headers=headers)
            return
        resp.send(200, orjson.dumps(whole.body(SYSTEM_FINGERPRINT)), headers=headers)
