"""The client port's vLLM routes beyond chat and completions (Gateway.route_other).

Generation routes, through admission and routing as chat: /v1/responses (the Responses
API: ``max_output_tokens``) and /v1/messages (Anthropic's Messages API: ``max_tokens``,
required). Relayed as they are to a healthy engine of the model: /v1/embeddings,
/tokenize, /detokenize and GET /version. GET /v1/models/{id} answers from the gateway's
own model list, as /v1/models does.
"""

from __future__ import annotations

import msgspec

from velocity_fast.gateway.errors import BadRequest
from velocity_fast.gateway.ingress import band_for, new_request_id, place_generation
from velocity_fast.gateway.request_types import GATEWAY_FIELDS, MAX_TOKENS_LIMIT
from velocity_fast.routing.errors import UnknownProfile

__all__ = ["OtherRoutes", "GENERATION_ROUTES", "RELAY_ROUTES", "MODEL_PREFIX"]

MODEL_PREFIX = "/v1/models/"
GENERATION_ROUTES = ("/v1/responses", "/v1/messages")
# Relayed routes: their method, and whether the body names the model.
RELAY_ROUTES = {
    "/v1/embeddings": ("POST", True),
    "/tokenize": ("POST", True),
    "/detokenize": ("POST", True),
    "/version": ("GET", False),
}
_RELAY_TIMEOUT = 60.0  # an embeddings batch is a whole prefill

_Tokens = msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)


class _Own(msgspec.Struct):
    priority: str | int | None = None
    sla_ms: float | None = None


class ResponsesBody(_Own, kw_only=True):
    """/v1/responses, as far as the gateway reads it."""

    input: str | list[msgspec.Raw]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    user: str | None = None


class MessagesBody(_Own, kw_only=True):
    """/v1/messages, as far as the gateway reads it (model and max_tokens are required there)."""

    model: str
    messages: list[msgspec.Raw]
    max_tokens: int
    system: str | list[msgspec.Raw] | None = None
    stream: bool = False


_decoders = {"/v1/responses": msgspec.json.Decoder(ResponsesBody), "/v1/messages": msgspec.json.Decoder(MessagesBody)}
_model_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_json = msgspec.json.decode


def _decode_error(e: msgspec.DecodeError) -> BadRequest:
    """The 400 for a body msgspec refused, naming the field (``param``) where it says one."""
    text = str(e)
    param = None
    if "$." in text:
        param = text.rsplit("$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] or None
    elif "missing required field `" in text:
        param = text.split("missing required field `", 1)[1].split("`", 1)[0] or None
    return BadRequest(f"Invalid request: {text}", param)


def _tokens(n: int | None, name: str) -> int | None:
    if n is None:
        return None
    if not 1 <= n <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"`{name}` must be between 1 and {MAX_TOKENS_LIMIT}, got {n}.", name)
    return n


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _messages(route: str, r) -> list[dict]:
    """The prompt as chat messages, for prefix routing (system first: the shared prefix)."""
    out = []
    system = r.instructions if route == "/v1/responses" else r.system
    if system:
        out.append(
            {"role": "system", "content": _text(system if isinstance(system, str) else [_json(p) for p in system])}
        )
    items = r.input if route == "/v1/responses" else r.messages
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    for raw in items:
        m = _json(raw)
        if isinstance(m, dict) and "role" in m:
            out.append({"role": str(m["role"]), "content": _text(m.get("content"))})
    return out


class OtherRoutes:
    """The routes above, for one Gateway (its pools, router, identity and admission)."""

    def __init__(self, gw) -> None:
        self.gw = gw

    def routes(self) -> list[str]:
        """Every route the client port serves, for an unknown route's 404."""
        return [
            "POST /v1/chat/completions",
            "POST /v1/completions",
            "POST /v1/responses",
            "POST /v1/messages",
            "POST /v1/embeddings",
            "POST /tokenize",
            "POST /detokenize",
            "GET /v1/models",
            "GET /v1/models/{id}",
            "GET /version",
            "POST /generate",
            "GET /stats",
            "GET /health",
        ]

    # -- GET /v1/models/{id} ----------------------------------------------------------
    def model(self, req, resp) -> None:
        gw = self.gw
        mid = req.path[len(MODEL_PREFIX) :]
        pool = gw.pools.get(mid)
        if pool is None or not pool.healthy():
            gw.count_answer("/v1/models/{id}", 404)
            return resp.send_error(404, f"The model `{mid}` does not exist.", type="NotFoundError", param="model")
        gw.count_answer("/v1/models/{id}", 200)
        resp.send_json(200, gw.model_object(mid, pool))

    # -- relayed --------------------------------------------------------------------
    def relay(self, req, resp, method: str, by_body: bool):
        gw = self.gw
        path = req.path
        if req.method != method:
            gw.count_answer(path, 405)
            return resp.send_error(405, f"Use {method} for {path}.")
        rid = req.headers.get("x-request-id") or new_request_id()
        hdrs = [("x-request-id", rid)]
        if by_body:
            try:
                obj = _model_decoder.decode(req.body) if req.body else {}
                model = msgspec.json.decode(obj["model"]) if "model" in obj else None
            except (msgspec.DecodeError, RecursionError) as e:
                gw.count_answer(path, 400)
                return resp.send_error(400, f"The request body is not a valid JSON object: {e}", headers=hdrs)
            model = model or gw.default_model
            pool = gw.pools.get(model) if isinstance(model, str) else None
            if pool is None:
                gw.count_answer(path, 404)
                return resp.send_error(
                    404, f"The model `{model}` does not exist.", type="NotFoundError", param="model", headers=hdrs
                )
            eps = pool.healthy()
        else:  # /version: every engine runs the same vLLM; any healthy one answers
            eps = [ep for p in gw.pools.values() for ep in p.healthy()]
        if not eps:
            gw.count_answer(path, 503)
            return resp.send_error(503, "No healthy engine to answer.", type="ServiceUnavailableError", headers=hdrs)
        ep = min(eps, key=lambda e: e.inflight)
        return self._relay(req, resp, ep, path, hdrs, rid)

    async def _relay(self, req, resp, ep, path: str, hdrs: list, rid: str) -> None:
        gw = self.gw
        up = [("x-request-id", rid)]
        if req.method == "POST":
            up.append(("content-type", "application/json"))
        if ep.api_key:
            up.append(("authorization", f"Bearer {ep.api_key}"))
        try:
            status, body = await ep.upstream.fetch(
                req.method, path, body=req.body or b"", headers=up, timeout=_RELAY_TIMEOUT
            )
        except Exception as e:  # the engine could not be reached or did not answer in time
            gw.count_answer(path, 502)
            return resp.send_error(502, f"The engine {ep.name} did not answer: {e}", headers=hdrs)
        gw.count_answer(path, status)
        hdrs.append(("x-velocity-endpoint", ep.name))
        resp.send(status, body, headers=hdrs)

    # -- generation -------------------------------------------------------------------
    def generate(self, req, resp) -> None:
        gw = self.gw
        route = req.path
        if req.method != "POST":
            gw.count_answer(route, 405)
            return resp.send_error(405, f"Use POST for {route}.")
        h = req.headers
        rid = h.get("x-request-id") or new_request_id()
        hdrs = [("x-request-id", rid)]
        band = "-"
        limit_name = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
        try:
            if not req.body:
                raise BadRequest("The request body is empty; a JSON object is expected.")
            try:
                r = _decoders[route].decode(req.body)
            except msgspec.DecodeError as e:
                raise _decode_error(e) from None
            except RecursionError:
                raise BadRequest("The request body is nested too deeply.") from None
            max_tokens = _tokens(getattr(r, limit_name), limit_name)
            if route == "/v1/messages" and not r.messages:
                raise BadRequest("`messages` is required and must be a non-empty list.", "messages")
            if r.sla_ms is not None and r.sla_ms <= 0:
                raise BadRequest(f"`sla_ms` must be positive, got {r.sla_ms}.", "sla_ms")
            _, bound = gw.identity.authenticate(h)
            user = r.user if route == "/v1/responses" else None
            tenant_name, tenant = gw.identity.tenant_for(bound, h.get("x-velocity-tenant"), user)
            prio = h.get("x-velocity-priority")
            band = band_for(gw.band_names, prio if prio is not None else r.priority, tenant, gw.default_band)
            sla_ms = gw.sla_for(h.get("x-velocity-sla-ms"), r.sla_ms)
            if sla_ms is None and tenant is not None:
                sla_ms = tenant.sla_ms
            model = r.model or gw.default_model
            info = gw.router.route_info(model, {"messages": _messages(route, r)}, h)
        except (BadRequest, UnknownProfile) as e:
            gw.metrics.requests.labels(route, 400, band).inc()
            return resp.send_error(400, str(e), param=getattr(e, "param", None), headers=hdrs)
        except (msgspec.DecodeError, RecursionError):
            gw.metrics.requests.labels(route, 400, band).inc()
            return resp.send_error(400, "Invalid request: the prompt's items are not JSON objects.", headers=hdrs)
        body = req.body
        if r.priority is not None or r.sla_ms is not None or b'"priority"' in body or b'"sla_ms"' in body:
            obj = _model_decoder.decode(body)  # the gateway's own fields: vLLM may refuse them
            for f in GATEWAY_FIELDS:
                obj.pop(f, None)
            body = msgspec.json.encode(obj)
        # From the pool on (context, quota, exchange), the same checks as the OpenAI routes.
        place_generation(
            gw.ingress,
            req,
            resp,
            route,
            rid,
            band,
            tenant,
            tenant_name,
            sla_ms,
            model,
            info,
            body,
            max_tokens,
            limit_name,
            r.stream is True,
        )
