"""The lease: an admission slot held for the whole response, stream included."""

from __future__ import annotations


__all__ = ["Lease", "OUTCOMES"]

OUTCOMES = ("completed", "failed", "cancelled")


class Lease:
    """Granted by ``Admission.admit``; ``bind`` when an endpoint is chosen,
    ``first_byte`` when the engine answers, ``release`` exactly once at the end
    (further calls are ignored).

    ``bind``/``release`` keep ``Endpoint.inflight`` up to date: nobody else should.
    Useful attributes: ``band`` (name), ``queue_ms``, ``endpoint``, ``deadline``.
    """

    __slots__ = ("_adm", "_ps", "band_index", "band", "tenant", "max_tokens", "deadline", "explicit_sla",
                 "arrived_at", "granted_at", "bound_at", "first_byte_at", "endpoint", "_st", "done")

    def __init__(self, adm, ps, band_index: int, band: str, tenant, max_tokens: int, deadline: float,
                 explicit_sla: bool, arrived_at: float, granted_at: float) -> None:
        self._adm = adm
        self._ps = ps
        self.band_index = band_index
        self.band = band
        self.tenant = tenant
        self.max_tokens = max_tokens
        self.deadline = deadline
        self.explicit_sla = explicit_sla
        self.arrived_at = arrived_at
        self.granted_at = granted_at
        self.bound_at = 0.0
        self.first_byte_at = 0.0
        self.endpoint = None
        self._st = None  # admission's state of the endpoint, kept from bind to release
        self.done = False

    @property
    def queue_ms(self) -> float:
        """Time spent waiting in admission, in milliseconds."""
        return (self.granted_at - self.arrived_at) * 1000.0

    def bind(self, ep) -> None:
        """The request is now in flight on ``ep``."""
        if self.endpoint is None:
            self.rebind(ep)

    def rebind(self, ep) -> None:
        """Move the request to ``ep`` (a retry elsewhere before any byte was sent);
        the first call binds it."""
        if self.done:
            return
        old = self.endpoint
        if old is not None:
            self._adm._on_unbind(self, old)
        self.endpoint = ep
        self.bound_at = self._adm.clock()
        self._adm._on_bind(self, ep, old is not None)

    def fits(self, ep) -> bool:
        """Room on ``ep`` for this lease's band (the router's filter): below the
        endpoint's limit and, for a band held back before saturation (ceiling below
        1), below that ceiling on this endpoint too — the pool may have headroom on
        another endpoint, and a low request must not take a full engine's last slots."""
        return self._adm._fits(self, ep)

    def first_byte(self) -> None:
        """The first byte of the response came back (time-to-first-token)."""
        if not self.first_byte_at and not self.done:
            self.first_byte_at = self._adm.clock()
            if self.endpoint is not None:
                self._adm._on_first_byte(self)

    def release(self, outcome: str = "completed", error_text: str | None = None, tokens: int = 0) -> None:
        """End the lease with one terminal outcome (idempotent)."""
        if self.done:
            return
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {outcome!r}")
        self.done = True
        self._adm._on_release(self, outcome, error_text, tokens)

    def __repr__(self) -> str:
        ep = getattr(self.endpoint, "name", None)
        return f"<Lease band={self.band} endpoint={ep} done={self.done}>"
