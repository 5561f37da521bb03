"""What admission is asked (a Ticket) and how it says no (Rejected)."""

from __future__ import annotations

__all__ = ["Ticket", "Rejected"]


class Ticket:
    """One request as admission sees it.

    ``band``: band name (None or unknown: the default band); ``tenant``: fairness
    key (None: anonymous); ``sla_ms``: the deadline the client asked for (None: no
    SLA prediction, the default deadline still counts for compliance);
    ``max_tokens``: output tokens asked for; ``prompt_bytes``: body size (queue byte
    limits, token fairness); ``model``: the pool (None: the default pool).
    """

    __slots__ = ("band", "tenant", "sla_ms", "max_tokens", "prompt_bytes", "model")

    def __init__(self, band: str | None = None, tenant: str | None = None, sla_ms: float | None = None,
                 max_tokens: int | None = 16, prompt_bytes: int = 0, model: str | None = None) -> None:
        self.band = band
        self.tenant = tenant
        self.sla_ms = sla_ms
        # None (the client did not say) counts as vLLM's completions default.
        self.max_tokens = int(max_tokens) if max_tokens is not None else 16
        self.prompt_bytes = int(prompt_bytes or 0)
        self.model = model

    def __repr__(self) -> str:
        return (f"Ticket(band={self.band!r}, tenant={self.tenant!r}, sla_ms={self.sla_ms}, "
                f"max_tokens={self.max_tokens}, prompt_bytes={self.prompt_bytes}, model={self.model!r})")


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
