"""Online estimators behind SLA prediction, learned per endpoint (EWMA).

Per endpoint: time to first token measured from dispatch (prefill plus the engine's
own queue), time per output token after the first, and whole service time. They
start unknown; until a first observation the prediction says nothing, so a cold
gateway never rejects on a guess. Compiled: the lease's release feeds them.
"""

__all__ = ["Ewma", "ServiceEstimate"]


cdef class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    def __cinit__(self, double alpha):
        self.alpha = alpha

    @property
    def value(self):
        return self._value if self.seen else None

    cdef void add(self, double x):
        self.samples += 1
        if not self.seen:
            self._value = x
            self.seen = True
        else:
            self._value += self.alpha * (x - self._value)

    def observe(self, double x):
        """Fold one sample in."""
        self.add(x)


cdef class ServiceEstimate:
    """How long one endpoint takes to serve a request (seconds). Each estimate starts
    unknown; until a first observation the prediction says nothing, so a cold gateway
    never rejects on a guess."""

    def __cinit__(self, double alpha):
        self.ttft = Ewma(alpha)
        self.tpot = Ewma(alpha)
        self.service = Ewma(alpha)

    cdef void first_byte(self, double ttft_s):
        if ttft_s >= 0:
            self.ttft.add(ttft_s)

    cdef void done(self, double ttft_s, double service_s, long tokens):
        # ttft_s < 0: no first byte was seen
        if ttft_s >= 0 and tokens > 1 and service_s > ttft_s:
            self.tpot.add((service_s - ttft_s) / (tokens - 1))
        self.service.add(service_s)

    cdef double expect(self, long max_tokens):
        """The prediction, or -1 when unknown."""
        if not self.ttft.seen:
            return self.service._value if self.service.seen else -1.0
        cdef double per = self.tpot._value if self.tpot.seen else 0.0
        return self.ttft._value + (max_tokens - 1 if max_tokens > 1 else 0) * per

    def observe_first_byte(self, double ttft_s):
        """A first byte came back ``ttft_s`` after dispatch. Learned at once, not at
        the end, so that a gateway under its first long requests can already predict."""
        self.first_byte(ttft_s)

    def observe(self, ttft_s, double service_s, long tokens):
        """One finished request: dispatch to first byte (None: none seen; already fed
        through ``observe_first_byte``), dispatch to end, tokens out."""
        self.done(-1.0 if ttft_s is None else <double>ttft_s, service_s, tokens)

    @property
    def known(self):
        """True once a first byte or a whole request has been seen here."""
        return self.ttft.seen or self.service.seen

    def predict(self, long max_tokens):
        """Expected service time of a request asking ``max_tokens``; None if unknown."""
        cdef double s = self.expect(max_tokens)
        return None if s < 0 else s

    def snapshot(self):
        """Current estimates in milliseconds (None when unknown)."""
        def ms(Ewma e):
            return round(e._value * 1000.0, 3) if e.seen else None
        return {"ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "service_ms": ms(self.service),
                "samples": self.service.samples}
