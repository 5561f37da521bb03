"""A replica's lease of one bucket shared through the state store, compiled.

The request path draws from it as C calls from identity.pyx (``Tenant.take``,
``take_tokens``, ``settle_tokens``); fleet/statestore.py fills it from Redis and switches it
to its local fallback while the store is unreachable (see that module's doc).
"""

from velocity_fast.lowlevel.clock cimport monotonic

LEASE_S = 0.1  # a lease is about this many seconds of the bucket's rate


cdef class SharedBucket:
    """This replica's lease of one shared bucket, and its local fallback.

    Units are requests (the request bucket) or engine tokens (the token bucket); ``rate``
    is units a second, ``cap`` the bucket's size. ``store`` is told when a refill is due
    (``ask(bucket)``) and when a settlement is owed (``owe(bucket)``)."""

    def __init__(self, store, str key, double rate, double cap, double floor):
        self.store = store
        self.key = key
        self.rate = rate
        self.cap = cap
        # The lease asked for: about LEASE_S of the rate, at least ``floor`` units and two of
        # the largest draws seen (so one is in hand while the next is fetched), at most the
        # bucket; refilled at half.
        self.chunk = min(cap, max(floor, rate * LEASE_S))
        self.low = self.chunk / 2
        self.need = 0.0
        self.lease = 0.0
        self.debt = 0.0
        self.asking = False
        self.not_before = 0.0
        self.shared_level = cap
        self.replicas = 0
        self.room = cap
        self.answered = 0.0
        self.up = False
        self.level = 0.0
        self.stamp = 0.0
        self.spent = 0.0

    cpdef double draw(self, double amount, double need) except -1:
        """Draw ``amount`` units if ``need`` are there: 0.0, else the seconds until they
        would be (a Retry-After). Never waits."""
        cdef double lease, short, now, level
        if not self.up:
            return self._draw_local(amount, need)
        if need > self.need:
            self._grow(need)
        lease = self.lease
        if lease >= need:
            self.lease = lease = lease - amount
            if lease <= self.low and not self.asking:
                self.store.ask(self)
            return 0.0
        if not self.asking:
            self.store.ask(self)
        if self.replicas == 1:
            # Short of lease, and no other replica holds one: the bucket's level is what
            # its last answer said, less what was drawn on it since, plus its refill up to
            # its room, exactly. Drawn from it as a debt, settled with the next round trip
            # (a burst larger than the lease is served as a local bucket would serve it).
            # With other replicas that view is stale (they take from the same level), and
            # a draw on it could pass the bucket: they wait for the refill.
            now = monotonic()
            level = min(self.room, self.shared_level + (now - self.answered) * self.rate)
            if level + lease >= need:
                short = amount - lease
                self.shared_level = level - short
                self.answered = now
                self.debt += short
                self.lease = 0.0
                self.store.owe(self)
                return 0.0
        return (need - lease) / self.rate

    cdef void _grow(self, double need) noexcept:
        self.need = need = min(need, self.cap)
        self.chunk = min(self.cap, max(self.chunk, 2 * need))
        self.low = self.chunk / 2

    cpdef settle(self, double delta):
        """The answer used ``delta`` units more than were drawn (fewer when negative)."""
        cdef double lease
        if not self.up:
            self._refill_local()
            self.level -= delta
            self.spent += delta
            return
        lease = self.lease - delta
        if lease < 0:  # more than this replica holds: a debt of the shared bucket
            self.debt -= lease
            self.shared_level += lease
            lease = 0.0
            self.store.owe(self)
        elif lease > 2 * self.chunk:  # more than it needs: back to the shared bucket
            self.debt -= lease - self.chunk
            self.shared_level += lease - self.chunk
            lease = self.chunk
            self.store.owe(self)
        self.lease = lease

    def left(self):
        """Units left: the shared level at the last answer and this replica's lease (the
        local bucket while the store is down)."""
        if not self.up:
            self._refill_local()
            return self.level
        return self.shared_level + self.lease

    cdef void _refill_local(self) noexcept:
        cdef double now = monotonic()
        self.level = min(self.cap, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    cdef double _draw_local(self, double amount, double need) noexcept:
        self._refill_local()
        if self.level >= need:
            self.level -= amount
            self.spent += amount
            return 0.0
        return (need - self.level) / self.rate

    def to_local(self):
        """The store is down: the local bucket starts from what this replica held, and the
        settlements not sent count as spent."""
        self.up = False
        self.level = self.lease
        self.stamp = monotonic()
        self.spent = self.debt
        self.lease = self.debt = 0.0
        self.asking = False
        self.not_before = 0.0
