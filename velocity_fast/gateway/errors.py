"""The gateway's exceptions."""

from __future__ import annotations

import os

__all__ = ["BadRequest", "ListenError", "context_error"]

# Where each port the gateway listens on is set, as an operator would change it.
_PORT_SOURCES = {
    "port": "--port, VELOCITY_PORT or `port` in the config file",
    "admin_port": "--admin-port, VELOCITY_ADMIN_PORT or `admin_port` in the config file",
}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def context_error(limit: int, asked: int) -> str:
    """vLLM's words for a completion longer than the model's context."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {asked} "
        "output tokens, and the prompt needs at least one more. Please reduce the length of the "
        "messages or completion."
    )


class ListenError(Exception):
    """A port the gateway was told to listen on cannot be had (in use, not permitted): one
    line naming the port and the settings that choose it, rather than the bind's traceback."""

    def __init__(self, key: str, host: str, port: int, error: OSError) -> None:
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        super().__init__(
            f"cannot listen on {host or '*'}:{port} ({key}): {reason}; stop what holds it or "
            f"choose another port with {_PORT_SOURCES[key]}"
        )
        self.key = key
        self.port = port
