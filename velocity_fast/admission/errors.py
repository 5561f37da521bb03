"""Admission's exceptions: how it says no to a request, and a bad admission configuration."""

from __future__ import annotations

import math

__all__ = ["Rejected", "AdmissionConfigError", "retry_headers"]


RETRY_AFTER_MAX_S = 86400.0


def retry_headers(retry_after: float) -> list[tuple[str, str]]:
    """When to come back, ``retry_after`` seconds from now: ``Retry-After`` in whole
    seconds as HTTP has it (rounded up, at least 1), and ``retry-after-ms``, the same time
    to the millisecond. One second is too coarse for a burst paced a few tens of
    milliseconds apart; the OpenAI clients read ``retry-after-ms`` before
    ``Retry-After`` (docs/operations.md, "Retry-After")."""
    # At most a day: a wait computed from a tiny rate stays a short header, and one that is
    # not finite never reaches ceil() (nan < x is false).
    if not retry_after < RETRY_AFTER_MAX_S:
        retry_after = RETRY_AFTER_MAX_S
    return [
        ("retry-after", str(max(1, math.ceil(retry_after - 1e-9)))),
        ("retry-after-ms", str(max(1, round(retry_after * 1000.0)))),
    ]


class AdmissionConfigError(ValueError):
    """An admission setting is wrong; the message names the key."""


class Rejected(Exception):
    """Admission declined the request: answer ``status`` with ``reason`` in
    ``x-velocity-reject-reason`` and, when set, the headers of ``retry_headers(retry_after)``
    (``retry_after`` in seconds, a float)."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    def headers(self) -> list[tuple[str, str]]:
        """The response headers this rejection calls for."""
        out = [("x-velocity-reject-reason", self.reason)]
        if self.retry_after is not None:
            out.extend(retry_headers(self.retry_after))
        return out

    def __repr__(self) -> str:
        return f"Rejected({self.status}, {self.reason!r}, {self.message!r}, retry_after={self.retry_after})"
