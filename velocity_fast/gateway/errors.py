"""The gateway's exceptions."""

from __future__ import annotations

__all__ = ["BadRequest"]


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
