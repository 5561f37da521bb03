"""Requests, limits and the error shape shared by every HTTP server of the package."""

from __future__ import annotations

import orjson

# One parsed HTTP request (method, path, query, headers, http_version, keep_alive, client,
# received_at, body, expect_continue; header() and a short repr): compiled, since the
# gateway's request path reads its fields as C (_core/message.pyx).
from .._core.message import Request

__all__ = ["Request", "ServerLimits", "ClientDisconnected", "error_body", "REASONS", "ERROR_TYPES"]


class ClientDisconnected(ConnectionError):
    """The client went away before the response was finished."""


class ServerLimits:
    """Limits a server enforces on every connection (each has its status code)."""

    __slots__ = ("max_body_bytes", "max_header_bytes", "header_timeout", "body_timeout",
                 "keepalive_timeout", "max_pipelined", "write_buffer_high", "linger_timeout", "first_byte_timeout")

    def __init__(self, *, max_body_bytes: int = 16 * 1024 * 1024, max_header_bytes: int = 64 * 1024,
                 header_timeout: float = 10.0, body_timeout: float = 60.0,
                 keepalive_timeout: float = 75.0, max_pipelined: int = 32,
                 write_buffer_high: int = 512 * 1024, linger_timeout: float = 2.0,
                 first_byte_timeout: float | None = None) -> None:
        self.max_body_bytes = max_body_bytes        # 413 past it
        self.max_header_bytes = max_header_bytes    # 431 past it (request line + headers)
        self.header_timeout = header_timeout        # 408 when a started head does not complete in time
        self.body_timeout = body_timeout            # 408 when a body does not complete in time
        self.keepalive_timeout = keepalive_timeout  # an idle connection is closed after it
        self.max_pipelined = max_pipelined          # reading pauses while this many wait their turn
        self.write_buffer_high = write_buffer_high  # write flow control: pause the producer above it
        self.linger_timeout = linger_timeout        # after an error answer, how long to wait for the client's EOF
        # A new connection that sends no byte of a request is closed (quietly, as nginx's
        # client_header_timeout does) after this; None: header_timeout. Between requests of a
        # kept-alive connection the wait is keepalive_timeout.
        self.first_byte_timeout = header_timeout if first_byte_timeout is None else first_byte_timeout


REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Payload Too Large",
    422: "Unprocessable Entity", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout",
}

# The `type` field of the error shape, by status, as OpenAI-style servers name them.
ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 405: "MethodNotAllowed", 408: "RequestTimeoutError",
    413: "RequestTooLargeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError", 500: "InternalServerError", 502: "BadGatewayError",
    503: "ServiceUnavailableError", 504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, type: str | None = None, param: str | None = None) -> bytes:
    """The one error shape: {"error": {"message", "type", "param", "code"}} with code = status."""
    return orjson.dumps({"error": {"message": message, "type": type or ERROR_TYPES.get(status, "Error"),
                                   "param": param, "code": status}})
