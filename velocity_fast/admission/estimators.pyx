"""Online estimators behind SLA prediction, learned per endpoint and per pool.

A request's service time is estimated from its own size: time to first token as a
line in the prompt's size (prefill grows with the prompt), then output tokens at the
learned time per token. Both are learned online:

* time per output token: from a stream, the time after the first byte over the tokens
  after the first; from a whole answer (no stream: its first byte is its last), the
  time past the expected first token over the tokens produced. A flood of short
  requests teaches the rate that a long one is then charged per token, so the estimate
  scales with ``max_tokens`` instead of repeating what short ones took.
* time to first token: an exponentially weighted least-squares line in the prompt's
  bytes, from streams only (a whole answer says nothing of its first token). While the
  prompts seen are all of one size, the line is flat (their mean).

Each estimate starts unknown; until a first observation the prediction says nothing,
so a cold gateway never rejects on a guess. Compiled: the lease's release feeds them.

A request that names no max tokens runs until the model stops: its length is taken from
what the pool's engines returned for such requests (``OutputEstimate``, the completion
tokens of their ``usage``), from a documented starting value until the first answer.
"""

from libc.math cimport ceil

__all__ = ["Ewma", "OutputEstimate", "ServiceEstimate", "OPEN_START_CHAT", "OPEN_START_TEXT", "OPEN_WINDOW"]

# The output tokens a request that names no max tokens is taken to ask for, until its pool
# has answered one: a chat reply runs until the model stops (128: a short answer's length,
# the sim engine's mean); /v1/completions stops at vLLM's default max_tokens, 16.
OPEN_START_CHAT = 128
OPEN_START_TEXT = 16
# The estimate is the mean of this many last answers, all alike: it follows a change of
# workload, and the order answers end in does not bias it (the longest replies of a burst
# end last, and a moving average would weigh them most).
OPEN_WINDOW = OPEN_RING

# A first byte this late in a request (as a share of its whole time) is an answer that
# came whole, not a stream: its first byte says nothing of its first token.
cdef double _WHOLE_ANSWER = 0.8


cdef class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    def __cinit__(self, double alpha):
        self.alpha = alpha

    @property
    def value(self):
        return self._value if self.seen else None

    cdef void _observe(self, double x):
        self.samples += 1
        if not self.seen:
            self._value = x
            self.seen = True
        else:
            self._value += self.alpha * (x - self._value)

    def observe(self, double x):
        """Fold one sample in."""
        self._observe(x)


cdef class ServiceEstimate:
    """How long one endpoint (or pool) takes to serve a request of a given size
    (seconds). Each estimate starts unknown; until a first observation the prediction
    says nothing, so a cold gateway never rejects on a guess."""

    def __cinit__(self, double alpha):
        self.ttft = Ewma(alpha)
        self.tpot = Ewma(alpha)
        self.service = Ewma(alpha)
        self.keep = 1.0 - alpha

    cpdef void observe_first_byte(self, double ttft_s):
        """A first byte came back ``ttft_s`` after dispatch (a negative time is not learned).
        Learned at once, not at the end, so that a gateway under its first long requests can
        already predict."""
        if ttft_s >= 0:
            self.ttft._observe(ttft_s)

    cdef double first_token(self, double nbytes):
        """Expected time to first token of a prompt of ``nbytes``: the learned line,
        never below zero (0 while no stream was seen)."""
        cdef double w = self.w, mx, var, slope, v
        if w <= 0.0:
            return self.ttft._value if self.ttft.seen else 0.0
        mx = self.sx / w
        var = self.sxx / w - mx * mx
        slope = 0.0
        # A spread of prompt sizes under a byte's square is one size: no slope to learn.
        if var > 1.0:
            slope = (self.sxy / w - mx * (self.sy / w)) / var
            if slope < 0.0:
                slope = 0.0
        v = self.sy / w + slope * (nbytes - mx)
        return v if v > 0.0 else 0.0

    cpdef void observe(self, double ttft_s, double service_s, long tokens, double nbytes=0.0):
        """One finished request: dispatch to first byte (negative: none seen), dispatch to
        end, tokens out, the prompt's size in bytes."""
        cdef double k = self.keep, first
        cdef bint stream = ttft_s >= 0 and service_s > 0 and ttft_s < _WHOLE_ANSWER * service_s
        if stream:
            self.w = self.w * k + 1.0
            self.sx = self.sx * k + nbytes
            self.sy = self.sy * k + ttft_s
            self.sxx = self.sxx * k + nbytes * nbytes
            self.sxy = self.sxy * k + nbytes * ttft_s
            self.streams += 1
            if tokens > 1:
                self.tpot._observe((service_s - ttft_s) / (tokens - 1))
        elif tokens > 0 and service_s > 0:
            first = self.first_token(nbytes) if self.streams else 0.0
            if first > service_s:
                first = 0.0
            self.tpot._observe((service_s - first) / tokens)
        self.service._observe(service_s)

    cdef double expect_size(self, double nbytes, long max_tokens):
        """The prediction for a prompt of ``nbytes`` asking ``max_tokens``, or -1 when unknown."""
        cdef long n = max_tokens if max_tokens > 0 else 1
        if not self.tpot.seen:
            if self.ttft.seen:
                return self.ttft._value
            return self.service._value if self.service.seen else -1.0
        if self.streams:
            return self.first_token(nbytes) + (n - 1) * self.tpot._value
        return n * self.tpot._value

    cdef double expect(self, long max_tokens):
        """The prediction for a short prompt, or -1 when unknown."""
        return self.expect_size(0.0, max_tokens)

    @property
    def known(self):
        """True once a first byte or a whole request has been seen here."""
        return self.ttft.seen or self.service.seen

    def predict(self, long max_tokens, double prompt_bytes=0.0):
        """Expected service time of a request of ``prompt_bytes`` asking ``max_tokens``;
        None if unknown."""
        cdef double s = self.expect_size(prompt_bytes, max_tokens)
        return None if s < 0 else s

    def snapshot(self):
        """Current estimates in milliseconds (None when unknown)."""
        def ms(Ewma e):
            return round(e._value * 1000.0, 3) if e.seen else None
        return {"ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "service_ms": ms(self.service),
                "samples": self.service.samples}


cdef class OutputEstimate:
    """The completion tokens of a pool's requests that name no max tokens: ``start``
    until the first answer, then the mean of the last ``OPEN_WINDOW`` answers'
    ``usage.completion_tokens``."""

    def __cinit__(self, double start):
        self.start = self.mean = start if start >= 1.0 else 1.0

    cpdef long expect(self):
        """The tokens to take such a request for (at least one)."""
        cdef long n = <long>ceil(self.mean)
        return n if n > 1 else 1

    cpdef void observe(self, long tokens):
        """One such request answered whole with ``tokens`` completion tokens (none: not learned)."""
        cdef long slot
        if tokens <= 0:
            return
        slot = self.answers % OPEN_RING
        if self.answers >= OPEN_RING:
            self.total -= self.ring[slot]
        self.ring[slot] = tokens
        self.total += tokens
        self.answers += 1
        self.mean = <double>self.total / (self.answers if self.answers < OPEN_RING else OPEN_RING)

    def snapshot(self) -> dict:
        """For /stats: the tokens taken now, the answers learned from, the starting value."""
        return {"tokens": self.expect(), "answers": self.answers, "start": <long>self.start}
