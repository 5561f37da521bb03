"""The sim engine's HTTP surface: vLLM's OpenAI routes, /health, /metrics and friends.

Every answer has vLLM's shape (docs/design.md, "The sim engine against vLLM"): routes, errors, SSE chunks,
auth on /v1/ paths only.
"""

from __future__ import annotations

import asyncio
import math
import os
import time

import msgspec
import orjson

from velocity_fast.http.message import Request
from velocity_fast.server.connection import Responder
from velocity_fast.sim.errors import BadRequest

from .engine import Engine, Sequence
from .extra import MODEL_PREFIX, extra_routes
from .pd import PULL_PATH, STATS_PATH, KVTransfer, role_of
from .responses import SYSTEM_FINGERPRINT, VLLM_VERSION, Choice, RequestMeta, StreamSink, WholeSink
from .schema import (
    ChatRequest,
    CompletionRequest,
    chat_decoder,
    completion_decoder,
    message_texts,
    render_chat,
    render_prompt,
    tokenize_decoder,
)
from .settings import SimConfig
from .tokens import (
    MAX_LOGPROBS,
    VOCAB_BITS,
    TextTokenizer,
    block_hashes,
    count_tokens,
    pseudo_token_ids,
    request_rng,
    stop_point,
    token_block_hashes,
)

_NOT_FOUND = b'{"detail":"Not Found"}'
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_UNAUTHORIZED = b'{"error":"Unauthorized"}'
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _priority(req: Request, body: ChatRequest | CompletionRequest) -> int:
    """The request's priority as vLLM 0.32 reads it: its ``X-Vllm-Priority`` header when that
    is an integer, else the body's ``priority`` (0 by default; lower runs first under
    ``--scheduling-policy priority``, and ``fcfs`` ignores it)."""
    h = req.headers.get("x-vllm-priority")
    if h is not None:
        try:
            return int(h)
        except ValueError:
            pass
    return body.priority


class SimAPI:
    """Routes requests to the engine; ``handle`` is the HTTPServer handler."""

    def __init__(self, cfg: SimConfig, engine: Engine, tokenizer: TextTokenizer | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self._auth = f"Bearer {cfg.api_key}" if cfg.api_key else None
        self._keep_alive = cfg.sse_keep_alive_interval / cfg.time_scale if cfg.sse_keep_alive_interval else None
        self._hash_seed = cfg.model.encode()
        self.kvx = KVTransfer(cfg, engine.kv)  # disaggregation's held blocks and pulls
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
            PULL_PATH: (("POST",), self._kv_pull),
            STATS_PATH: (("GET",), self._kv_stats),
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
        resp.send_json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "vllm",
                        "root": cfg.root or cfg.model,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{self.created:x}",
                                "object": "model_permission",
                                "created": self.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            },
        )

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
            ids = (
                self.tokenizer.encode_chat(message_texts(body.messages))
                if body.messages is not None
                else self._prompt_ids(body.prompt)
            )
        else:
            # Pseudo token ids from the bytes they stand for: stable for the same text.
            ids = pseudo_token_ids(data)
        resp.send_json(
            200, {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def _kv_pull(self, req: Request, resp: Responder) -> None:
        status, out = await self.kvx.serve_pull(req.body)
        if not resp.disconnected:
            resp.send_json(status, out)

    async def _kv_stats(self, req: Request, resp: Responder) -> None:
        resp.send_json(200, self.kvx.stats())

    async def _reset_prefix_cache(self, req: Request, resp: Responder) -> None:
        # vLLM's dev-mode route: ?reset_running_requests=true preempts what runs first.
        running = "reset_running_requests=true" in (req.query or "").lower()
        if self.engine.reset_prefix_cache(running):
            resp.send(200, b"", content_type=None)
            return
        resp.send_error(
            409,
            f"Failed to reset prefix cache: {self.engine.kv.used} blocks are in use by running "
            "requests (pass reset_running_requests=true to preempt them).",
            type="ConflictError",
        )

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
                raise _Schema("Field required: messages must be a non-empty list.", "body.messages")
            prompt = render_chat(body.messages)
            ids = self.tokenizer.encode_chat(message_texts(body.messages)) if self.tokenizer is not None else None
        except (msgspec.DecodeError, BadRequest, ValueError) as e:
            resp.send_error(400, str(e), type=_type_of(e), param=_param_of(e))
            return
        mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        await self._generate(req, resp, body, prompt, mt, chat=True, ids=ids)

    async def _completions(self, req: Request, resp: Responder) -> None:
        try:
            body = completion_decoder.decode(req.body)
            prompt = render_prompt(body.prompt)
            ids = self._prompt_ids(body.prompt) if self.tokenizer is not None else None
        except (msgspec.DecodeError, ValueError) as e:
            resp.send_error(400, str(e), type=_type_of(e), param=_param_of(e))
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
            raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
        _check_sampling(body)
        if prompt_tokens >= cfg.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
        # As vLLM 0.32: max_tokens alone is checked against the context; a prompt plus
        # max_tokens past it is served, and generation stops at the context's end.
        if max_tokens is not None and max_tokens > cfg.max_model_len:
            raise BadRequest(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={cfg.max_model_len}. Please "
                f"request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )

    def _plan(
        self, rng, body: ChatRequest | CompletionRequest, prompt_tokens: int, max_tokens: int | None
    ) -> tuple[int, str, tuple[int, int, str] | None]:
        """How one reply drawn from ``rng`` ends: (tokens, finish_reason, stop cut or None)."""
        cfg = self.cfg
        if max_tokens is not None and not (cfg.natural_stop and not body.ignore_eos):
            target, finish = min(max_tokens, cfg.max_model_len - prompt_tokens), "length"
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
        stops = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop or () if s]
        cut = stop_point(rng, target, stops) if stops and stops[0] else None
        if cut is not None:  # the reply meets a stop string: it ends there, without it
            target, finish = cut[0], "stop"
        return target, finish, cut

    def _end_siblings(self, seqs: list[Sequence]) -> None:
        # The response is over (a failure of one choice ends it): the other choices stop.
        if len(seqs) > 1:
            for seq in seqs:
                self.engine.abort(seq)

    async def _generate(
        self,
        req: Request,
        resp: Responder,
        body: ChatRequest | CompletionRequest,
        prompt: bytes,
        max_tokens: int | None,
        *,
        chat: bool,
        ids: list[int] | None = None,
    ) -> None:
        cfg = self.cfg
        if not self._model_ok(body.model, resp):
            return
        prompt_tokens = count_tokens(prompt) if ids is None else max(1, len(ids))
        try:
            self._validate(body, prompt_tokens, max_tokens)
        except BadRequest as e:
            resp.send_error(400, str(e), type="BadRequestError", param=e.param)
            return
        n = body.n or 1
        logprobs = _logprobs_asked(body)
        # Choice 0 draws from the request's own generator (n = 1 gives what it always
        # gave); each further choice from its own, so the n replies differ.
        rngs = [request_rng(cfg.seed, prompt)]
        rngs += [request_rng(cfg.seed, prompt + b"\x00choice %d" % i) for i in range(1, n)]
        plans = [self._plan(rng, body, prompt_tokens, max_tokens) for rng in rngs]
        failure = self.engine.plan_failure(plans[0][0])
        if failure is not None and failure.at == 0:
            resp.send_error(failure.status, failure.message, type=failure.type)
            return
        xid = req.headers.get("x-request-id")
        rid = ("chatcmpl-" if chat else "cmpl-") + (xid if xid else os.urandom(16).hex())
        so = body.stream_options
        # As vLLM: per-chunk usage only when usage was asked for at all.
        include_usage = bool(so and so.include_usage)
        meta = RequestMeta(
            rid,
            int(time.time()),
            cfg.model,
            chat,
            prompt_tokens,
            include_usage,
            include_usage and bool(so.continuous_usage_stats),
            cfg.enable_prompt_tokens_details,
        )
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
        role = role_of(body.kv_transfer_params)
        external = 0
        if role == "decode" and await self.kvx.pull(body.kv_transfer_params):
            external = prompt_tokens - 1  # the prompt's KV came over: its last token is computed
        if resp.disconnected:
            return
        sink = (
            StreamSink(resp, meta, n, logprobs)
            if body.stream
            else WholeSink(meta, asyncio.get_running_loop().create_future(), n, logprobs)
        )
        # n > 1: one sequence per choice, as vLLM fans the request out; they share the
        # prompt's cached blocks. A planned failure hits the first.
        seqs = []
        for i, (target, finish, cut) in enumerate(plans):
            if cut is not None:
                sink.stop_at(cut[1], cut[2], i)
            seqs.append(
                Sequence(
                    prompt_tokens,
                    hashes,
                    target,
                    finish,
                    rngs[i],
                    sink if n == 1 else Choice(sink, i),
                    failure if i == 0 else None,
                    ids,
                )
            )
        if external:
            for seq in seqs:
                seq.external = external
        prio = _priority(req, body)
        if prio:
            for seq in seqs:
                seq.priority = prio
        hold = role == "prefill" and not body.stream and n == 1
        if hold:
            seqs[0].keep = lambda seq: self.kvx.keep(rid, seq)
        meta.seq = seqs[0]
        if n == 1:
            seq = seqs[0]
            resp.add_disconnect_callback(lambda: engine.abort(seq))
        else:
            resp.add_disconnect_callback(lambda: [engine.abort(s) for s in seqs])
        if body.stream:
            resp.start(200, headers=headers)
            for seq in seqs:
                engine.submit(seq)
            await sink.run(self._keep_alive)
            self._end_siblings(seqs)
            resp.end()
            return
        for seq in seqs:
            engine.submit(seq)
        await sink.done
        self._end_siblings(seqs)
        if resp.disconnected:
            return
        if sink.error is not None:
            status, type, message = sink.error
            resp.send_error(status, message, type=type, headers=headers)
            return
        out = sink.body(SYSTEM_FINGERPRINT)
        if hold:
            out["kv_transfer_params"] = self.kvx.params_for(rid, prompt_tokens)
        resp.send(200, orjson.dumps(out), headers=headers)


class _Schema(BadRequest):
    """A body that does not fit the request model: vLLM's API server refuses it before its
    own checks, as FastAPI's validation error ("Bad Request", the field as ``body.NAME``)."""


def _type_of(e: Exception) -> str:
    """vLLM's error type: "Bad Request" for a body that is not the request model (bad JSON,
    a missing field, a wrong type), BadRequestError for what its own checks refuse."""
    return "Bad Request" if isinstance(e, (msgspec.DecodeError, _Schema)) else "BadRequestError"


def _param_of(e: Exception) -> str | None:
    """The field a refused body is refused for: BadRequest's, or for a body that is not the
    request model the first member of msgspec's path (``... - at `$.temperature` ``) as
    vLLM names it (``body.temperature``; ``body`` for what is not JSON)."""
    if isinstance(e, BadRequest):
        return e.param
    msg = str(e)
    at = msg.rfind("- at `$.")
    if at < 0:
        return "body" if isinstance(e, msgspec.DecodeError) else None
    name = msg[at + 8 :].rstrip("`").split(".")[0].split("[")[0]
    return "body." + name if name else "body"


#: vLLM's VLLM_MAX_N_SEQUENCES default: the largest ``n``.
MAX_N = 16384


def _check_sampling(body: ChatRequest | CompletionRequest) -> None:
    """vLLM's checks of the sampling fields (SamplingParams and the request models), with
    its messages; raises BadRequest. Types were checked when the body was decoded."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise BadRequest(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(body, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise BadRequest(f"{name} must be in [-2, 2], got {v}.")
    t = body.temperature
    if t is not None:
        if not math.isfinite(t):
            raise BadRequest(f"temperature must be a finite number, got {t}.", "temperature", t)
        if t < 0:
            raise BadRequest(f"temperature must be non-negative, got {t}.", "temperature", t)
        if t > 2.0:
            raise BadRequest(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    p = body.top_p
    if p is not None and not 0.0 < p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {p}.", "top_p", p)
    stop = body.stop
    if stop is not None and (stop == "" or (not isinstance(stop, str) and "" in stop)):
        raise BadRequest("stop cannot contain an empty string.")
    if t is not None and t < 1e-5 and n > 1:  # vLLM: zero temperature is greedy sampling
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.")
    k = _logprobs_asked(body)
    if k is not None and k > MAX_LOGPROBS:
        raise BadRequest(
            f"Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}", "logprobs", k
        )
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema" and rf.get("json_schema") is None:
            raise BadRequest(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                "response_format",
            )
        if kind != "text":
            # vLLM constrains the output (structured outputs); the sim's text is not.
            raise BadRequest(
                f"response_format type {kind!r} is not supported by the sim engine: it does not "
                "implement structured outputs.",
                "response_format",
            )
    if isinstance(body, ChatRequest):
        _check_tools(body)


def _logprobs_asked(body: ChatRequest | CompletionRequest) -> int | None:
    """How many top logprobs each token carries: None when logprobs are not asked for;
    raises BadRequest for vLLM's refusals."""
    vocab = 1 << VOCAB_BITS  # -1 asks for the whole vocabulary
    if isinstance(body, ChatRequest):
        k = body.top_logprobs
        if k is not None:
            if k < 0 and k != -1:
                raise BadRequest("`top_logprobs` must be a positive value or -1.", "top_logprobs", k)
            if (k == -1 or k > 0) and not body.logprobs:
                raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if not body.logprobs:
            return None
        k = k or 0
        return vocab if k == -1 else k
    k = body.logprobs
    if k is None:
        return None
    if k < 0 and k != -1:
        raise BadRequest(f"logprobs must be non-negative or -1, got {k}.", "logprobs", k)
    return vocab if k == -1 else k


def _check_tools(body: ChatRequest) -> None:
    """vLLM's checks of ``tools`` and ``tool_choice``; then what vLLM serves only with a
    tool parser or structured outputs, which the sim has neither of, is refused."""
    tools, choice = body.tools, body.tool_choice
    if tools is not None and not tools:
        raise BadRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"
        )
    if choice is msgspec.UNSET:
        choice = "auto" if tools else None
    if choice is None or choice == "none":
        return
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        # vLLM's own refusal without --enable-auto-tool-choice, which the sim never has.
        raise BadRequest(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"
        )
    if choice != "required" and not isinstance(choice, dict):
        raise BadRequest(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    what = '"required"' if choice == "required" else "a named function"
    raise BadRequest(
        f"tool_choice {what} is not supported by the sim engine: it does not generate tool calls.", "tool_choice"
    )
