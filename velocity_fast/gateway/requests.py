"""Decoding client requests: only the fields the gateway needs (the body is forwarded as is).

The Structs, BadRequest and GATEWAY_FIELDS live in gateway/request_types.py; the
functions (run on every proxied request) are compiled in _core/requests.pyx.
This module re-exports both.
"""

from __future__ import annotations

from .._core.requests import decode_generate, decode_proxy, strip_own_fields
from .request_types import GATEWAY_FIELDS, BadRequest, GenerateRequest, ProxyRequest

__all__ = ["ProxyRequest", "GenerateRequest", "BadRequest", "decode_proxy", "decode_generate",
           "strip_own_fields", "GATEWAY_FIELDS"]
