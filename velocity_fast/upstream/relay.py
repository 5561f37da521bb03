"""How vLLM reports an error after a stream began, for the exchange to relay."""

from __future__ import annotations

import orjson

__all__ = ["stream_error_event"]

_DONE = b"data: [DONE]\n\n"


def stream_error_event(message: str, status: int = 500, type: str = "InternalServerError") -> bytes:
    """How vLLM reports an error after streaming began: an error event, then [DONE]."""
    return b"data: " + orjson.dumps({"error": {"message": message, "type": type, "param": None,
                                               "code": status}}) + b"\n\n" + _DONE
