"""Adaptive concurrency per engine: additive increase, multiplicative decrease.

A new engine's limit starts low and, while its scrapes show it running everything it
was sent and work waits, grows by half per scrape (slow start, ended by the first
decrease); then by one per completion while there is queued work, the engine is at its
limit and its latency and KV cache are healthy; it shrinks by a quarter on an SLA breach or KV
past its hard limit; an out-of-memory error drops it to the minimum and freezes
increases for a cool-down. An engine that sat idle gets its starting limit back (when a
cut left it below) and a new slow start: whatever cut it is over, and a burst after a
quiet spell is admitted as by a fresh gateway.

Breaches come in bursts (every request of an overloaded batch ends late), so one
window of requests may cut the limit only once: a breach by a request that started
before the last decrease is the old limit's fault and is ignored, as TCP counts one
loss per window.
"""

AIMD_INCREASE = VF_AIMD_INCREASE
AIMD_DECREASE = VF_AIMD_DECREASE
AIMD_COOLDOWN_S = VF_AIMD_COOLDOWN_S


cdef class AimdLimit:
    """One engine's limit between ``minimum`` and ``maximum``."""

    def __cinit__(self, int minimum, int maximum, int initial=-1,
                  double cooldown=VF_AIMD_COOLDOWN_S):
        if minimum < 1 or maximum < minimum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {minimum}..{maximum}")
        if initial < 0:
            initial = maximum
        if initial < minimum:
            initial = minimum
        if initial > maximum:
            initial = maximum
        self.minimum = minimum
        self.maximum = maximum
        self.value = self.initial = initial
        self.slow = True
        self.cooldown = cooldown
        self.last_decrease = -1e300
        self.frozen_until = -1e300

    @property
    def limit(self):
        """The limit as a whole number of concurrent requests."""
        return <int>self.value

    cpdef bint frozen(self, double now):
        """True while an OOM cool-down is in force."""
        return now < self.frozen_until

    cpdef bint on_sample(self, bint queued, bint at_limit, bint healthy, double now):
        """A completion on a healthy path: +1 when the limit is what holds work
        back. Returns True when the limit changed."""
        if not (queued and at_limit and healthy) or now < self.frozen_until:
            return False
        if self.value >= self.maximum:
            return False
        self.value += VF_AIMD_INCREASE
        if self.value > self.maximum:
            self.value = self.maximum
        self.increases += 1
        return True

    cpdef bint on_probe(self, double now):
        """Slow start: the engine ran everything it was sent and work waits for this
        limit, so the limit grows by half (at least one) at once, until the first
        decrease ends the slow start. Returns True when it changed."""
        cdef double v
        if not self.slow or now < self.frozen_until or self.value >= self.maximum:
            return False
        v = self.value * 1.5
        if v < self.value + 1.0:
            v = self.value + 1.0
        if v > self.maximum:
            v = self.maximum
        self.value = <int>v
        self.increases += 1
        return True

    cpdef bint on_breach(self, double started_at, double now):
        """An SLA breach (or KV past its hard limit) of a request that started at
        ``started_at``: x0.75, once per window. Returns True when it changed."""
        cdef double v
        if started_at < self.last_decrease:
            return False
        self.last_decrease = now
        v = self.value * VF_AIMD_DECREASE
        if v < self.minimum:
            v = self.minimum
        if v == self.value:
            return False
        self.value = v
        self.decreases += 1
        self.slow = False
        return True

    cpdef void on_oom(self, double now):
        """The engine ran out of memory: minimum now, no increase for the cool-down."""
        self.value = self.minimum
        self.frozen_until = now + self.cooldown
        self.last_decrease = now
        self.ooms += 1
        self.slow = False

    cpdef bint on_idle(self, double now):
        """The engine sat idle (nothing in flight or running) for a while: the starting
        limit again if a cut left it below, and slow start open again, as for a new
        engine; not during an out-of-memory cool-down. True when the limit changed."""
        if now < self.frozen_until:
            return False
        self.slow = True
        if self.value >= self.initial:
            return False
        self.value = self.initial
        return True

    def __repr__(self):
        return f"AimdLimit({self.minimum}..{self.maximum}, limit={<int>self.value})"
