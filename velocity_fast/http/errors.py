"""The HTTP error contract: status reasons, the OpenAI error shape, and vLLM's error event after a
stream began."""

from __future__ import annotations

import orjson

__all__ = ["REASONS", "ERROR_TYPES", "error_body", "stream_error_event"]

_DONE = b"data: [DONE]\n\n"

REASONS = {
    100: "Continue",
    200: "OK",
    201: "Created",
    202: "Accepted",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

# The `type` field of the error shape, by status, as OpenAI-style servers name them.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, type: str | None = None, param: str | None = None) -> bytes:
    """The one error shape: {"error": {"message", "type", "param", "code"}} with code = status."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": type or ERROR_TYPES.get(status, "Error"),
                "param": param,
                "code": status,
            }
        }
    )


def stream_error_event(message: str, status: int = 500, type: str = "InternalServerError") -> bytes:
    """How vLLM reports an error after streaming began: an error event, then [DONE]."""
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": status}})
        + b"\n\n"
        + _DONE
    )
