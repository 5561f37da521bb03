"""The gateway's exceptions."""

from __future__ import annotations

__all__ = ["BadRequest", "context_error"]


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def context_error(limit: int, asked: int) -> str:
    """vLLM's words for a completion longer than the model's context."""
    return (f"This model's maximum context length is {limit} tokens. However, you requested {asked} "
            "output tokens, and the prompt needs at least one more. Please reduce the length of the "
            "messages or completion.")
