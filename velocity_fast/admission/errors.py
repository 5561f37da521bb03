"""Admission's exceptions: how it says no to a request, and a bad admission configuration."""

from __future__ import annotations

__all__ = ["Rejected", "AdmissionConfigError"]


class AdmissionConfigError(ValueError):
    """An admission setting is wrong; the message names the key."""


class Rejected(Exception):
    """Admission declined the request: answer ``status`` with ``reason`` in
    ``x-velocity-reject-reason`` and, when set, ``Retry-After: retry_after``."""

    def __init__(self, status: int, reason: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    def headers(self) -> list[tuple[str, str]]:
        """The response headers this rejection calls for."""
        out = [("x-velocity-reject-reason", self.reason)]
        if self.retry_after is not None:
            out.append(("retry-after", str(self.retry_after)))
        return out

    def __repr__(self) -> str:
        return f"Rejected({self.status}, {self.reason!r}, {self.message!r}, retry_after={self.retry_after})"
