"""Decoding client requests: only the fields the gateway needs (the body is forwarded as is)."""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = ["ProxyRequest", "GenerateRequest", "BadRequest", "decode_proxy", "decode_generate",
           "strip_own_fields", "GATEWAY_FIELDS"]

# Fields that belong to the gateway: engines may refuse them (vLLM answers 400 to
# `priority` unless it runs the priority scheduler), so they are removed before forwarding.
GATEWAY_FIELDS = ("priority", "sla_ms")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ProxyRequest(msgspec.Struct):
    """/v1/chat/completions and /v1/completions, as far as the gateway reads them."""

    model: str | None = None
    messages: list[Any] | None = None
    prompt: Union[str, list[Any], None] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    priority: Union[str, int, None] = None
    sla_ms: float | None = None
    user: str | None = None


class GenerateRequest(msgspec.Struct):
    """The native /generate route."""

    prompt: str
    max_tokens: int = 128
    priority: Union[str, int, None] = None
    sla_ms: float | None = None
    stream: bool = False
    model: str | None = None
    temperature: float | None = None


_proxy_decoder = msgspec.json.Decoder(ProxyRequest)
_generate_decoder = msgspec.json.Decoder(GenerateRequest)
_raw_object_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _explain(e: msgspec.DecodeError) -> BadRequest:
    text = str(e)
    param = None
    if "$." in text:
        param = text.rsplit("$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] or None
    elif "missing required field `" in text:  # at the top level msgspec names the field, not a path
        param = text.split("missing required field `", 1)[1].split("`", 1)[0] or None
    if isinstance(e, msgspec.ValidationError):
        return BadRequest(f"Invalid request: {text}", param)
    return BadRequest(f"The request body is not valid JSON: {text}")


def decode_proxy(body: bytes, chat: bool) -> ProxyRequest:
    if not body:
        raise BadRequest("The request body is empty; a JSON object is expected.")
    try:
        r = _proxy_decoder.decode(body)
    except msgspec.DecodeError as e:
        raise _explain(e) from None
    if chat:
        if not r.messages:
            raise BadRequest("`messages` is required and must be a non-empty list.", "messages")
    elif r.prompt is None or r.prompt == "" or r.prompt == []:
        raise BadRequest("`prompt` is required.", "prompt")
    if r.max_tokens is not None and r.max_tokens < 1:
        raise BadRequest(f"`max_tokens` must be at least 1, got {r.max_tokens}.", "max_tokens")
    if r.max_completion_tokens is not None and r.max_completion_tokens < 1:
        raise BadRequest(f"`max_completion_tokens` must be at least 1, got {r.max_completion_tokens}.",
                         "max_completion_tokens")
    if r.sla_ms is not None and r.sla_ms <= 0:
        raise BadRequest(f"`sla_ms` must be positive, got {r.sla_ms}.", "sla_ms")
    if r.stream_options is not None and not r.stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    return r


def decode_generate(body: bytes) -> GenerateRequest:
    if not body:
        raise BadRequest("The request body is empty; a JSON object is expected.")
    try:
        r = _generate_decoder.decode(body)
    except msgspec.DecodeError as e:
        raise _explain(e) from None
    if r.max_tokens < 1:
        raise BadRequest(f"`max_tokens` must be at least 1, got {r.max_tokens}.", "max_tokens")
    if r.sla_ms is not None and r.sla_ms <= 0:
        raise BadRequest(f"`sla_ms` must be positive, got {r.sla_ms}.", "sla_ms")
    return r


def strip_own_fields(body: bytes, r: ProxyRequest) -> bytes:
    """The body to forward: byte for byte, unless it carries gateway fields."""
    # find, not `in`: on bytes `in` first tries its operand as an integer, and so raises
    # and clears a TypeError each time (a few thousand instructions per request).
    if r.priority is None and r.sla_ms is None and body.find(b'"priority"') < 0 and body.find(b'"sla_ms"') < 0:
        return body
    # Values stay raw bytes: a full decode/encode would turn a 20-digit seed into a float
    # and reformat numbers the engine may read differently.
    obj = _raw_object_decoder.decode(body)
    removed = False
    for f in GATEWAY_FIELDS:
        if obj.pop(f, None) is not None:
            removed = True
    return msgspec.json.encode(obj) if removed else body
