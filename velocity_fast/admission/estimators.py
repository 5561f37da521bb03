"""Online estimators behind SLA prediction, learned per endpoint (EWMA).

Per endpoint: time to first token measured from dispatch (prefill plus the engine's
own queue), time per output token after the first, and whole service time. They
start unknown; until a first observation the prediction says nothing, so a cold
gateway never rejects on a guess.
"""

from __future__ import annotations

__all__ = ["Ewma", "ServiceEstimate"]


class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    __slots__ = ("alpha", "value", "samples")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def observe(self, x: float) -> None:
        """Fold one sample in."""
        self.samples += 1
        if self.value is None:
            self.value = x
        else:
            self.value += self.alpha * (x - self.value)


class ServiceEstimate:
    """How long one endpoint takes to serve a request (seconds)."""

    __slots__ = ("ttft", "tpot", "service")

    def __init__(self, alpha: float) -> None:
        self.ttft = Ewma(alpha)
        self.tpot = Ewma(alpha)
        self.service = Ewma(alpha)

    def observe_first_byte(self, ttft_s: float) -> None:
        """A first byte came back ``ttft_s`` after dispatch. Learned at once, not at
        the end, so that a gateway under its first long requests can already
        predict."""
        if ttft_s >= 0:
            self.ttft.observe(ttft_s)

    def observe(self, ttft_s: float | None, service_s: float, tokens: int) -> None:
        """One finished request: dispatch to first byte (already fed through
        ``observe_first_byte``), dispatch to end, tokens out."""
        if ttft_s is not None and ttft_s >= 0 and tokens > 1 and service_s > ttft_s:
            self.tpot.observe((service_s - ttft_s) / (tokens - 1))
        self.service.observe(service_s)

    @property
    def known(self) -> bool:
        """True once a first byte or a whole request has been seen here."""
        return self.ttft.value is not None or self.service.value is not None

    def predict(self, max_tokens: int) -> float | None:
        """Expected service time of a request asking ``max_tokens``; None if unknown."""
        if self.ttft.value is None:
            return self.service.value
        per = self.tpot.value or 0.0
        return self.ttft.value + max(0, max_tokens - 1) * per

    def snapshot(self) -> dict:
        """Current estimates in milliseconds (None when unknown)."""
        def ms(e: Ewma):
            return None if e.value is None else round(e.value * 1000.0, 3)
        return {"ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "service_ms": ms(self.service),
                "samples": self.service.samples}
