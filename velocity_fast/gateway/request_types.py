"""What the gateway decodes of a client request: the msgspec Structs (the schema).

The decoding itself is gateway/requests.pyx, the one request decoder.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

__all__ = ["ProxyRequest", "GenerateRequest", "StreamOptions", "GATEWAY_FIELDS", "MAX_TOKENS_LIMIT"]

# Fields that belong to the gateway: engines may refuse them (vLLM answers 400 to
# `priority` unless it runs the priority scheduler), so they are removed before forwarding.
GATEWAY_FIELDS = ("priority", "sla_ms")

# The largest max_tokens / max_completion_tokens the gateway accepts (a 32-bit count, far
# past any engine's context): above it a 400 names the field. Admission keeps the number
# in a C long and /generate forwards it through orjson, which would both overflow at 2**63.
# ProxyRequest's are checked in C after decoding (gateway/requests.pyx: a constrained type
# costs msgspec about 130 instructions a request); /generate's by the decoder (Meta).
MAX_TOKENS_LIMIT = 2**31 - 1
_Tokens = Annotated[int, msgspec.Meta(le=MAX_TOKENS_LIMIT)]


# gc=False: what a decoded body holds (strings, numbers, raw JSON, lists of those) cannot
# refer back to the request, so the collector need not track one per request.
class StreamOptions(msgspec.Struct, gc=False):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ProxyRequest(msgspec.Struct, gc=False):
    """/v1/chat/completions and /v1/completions, as far as the gateway reads them."""

    model: str | None = None
    # The messages kept as their raw JSON array: the gateway forwards the body as it
    # came, and only prefix routing reads them (as JSON text: routing/blockscan.pyx).
    # For a large body they are a span of the body itself (gateway/requests.pyx).
    # Empty when absent; decode_proxy checks that it is a non-empty array.
    messages: msgspec.Raw = msgspec.Raw()
    # The completions prompt, raw like messages (a string, a list of strings, token ids
    # or lists of them, or null: decode_proxy checks which); prefix routing hashes its
    # JSON text as it came (routing/blockscan.pyx's hash_json).
    prompt: msgspec.Raw = msgspec.Raw()
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None  # 1..MAX_TOKENS_LIMIT, checked by decode_proxy
    max_completion_tokens: int | None = None
    # UNSET when the body does not name them (None when it says null): the body then
    # goes to the engine as it came, without looking for them in it.
    priority: Union[str, int, None, msgspec.UnsetType] = msgspec.UNSET
    sla_ms: Union[float, None, msgspec.UnsetType] = msgspec.UNSET
    user: str | None = None


class GenerateRequest(msgspec.Struct):
    """The native /generate route."""

    prompt: str
    max_tokens: _Tokens = 128
    priority: Union[str, int, None] = None
    sla_ms: float | None = None
    stream: bool = False
    model: str | None = None
    temperature: float | None = None
