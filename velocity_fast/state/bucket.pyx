"""A token bucket (``draw``, ``settle``, ``left``) and its three homes, compiled.

Where a bucket lives is chosen once, when it is made (``make_bucket``), from the
config: in this process (``LocalBucket``), in the memory the gateway's workers share
(``ShmBucket``: one GCRA cell of csrc/shared_state.h, drawn by every worker), or in the
state store every replica shares (``StoreBucket``: this replica's share of a Redis bucket,
state/store.py). The request path draws and settles as C calls on the base class's
``draw_at`` and ``settle_at``: one virtual call, no Python frame and no branch on the home.

Units are requests (a tenant's request bucket) or engine tokens (its token bucket);
``rate`` is units a second, ``cap`` the bucket's size. A draw of ``amount`` needs
``need`` units there (a draw past the bucket's size needs a full one) and answers 0.0
(drawn) or the seconds until they would be there (a Retry-After). A settlement after the
answer may take the level below zero: a debt that later draws wait out.
"""

from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.state.shm cimport (TenantSlot, tenant_slot, vf_cell_config, vf_cell_draw, vf_cell_left,
                                      vf_cell_settle)

__all__ = ["Bucket", "LocalBucket", "ShmBucket", "StoreBucket", "make_bucket", "SHARE_S"]

SHARE_S = 0.1  # a replica's share of a store bucket is about this many seconds of its rate


cdef class Bucket:
    """The interface: ``draw``, ``settle`` and ``left`` (as C: the ``_at`` methods)."""

    cdef double draw_at(self, double amount, double need, double now) except -1:
        raise NotImplementedError

    cdef int settle_at(self, double delta, double now) except -1:
        raise NotImplementedError

    cdef double left_at(self, double now) noexcept:
        return 0.0

    cpdef take_over(self, Bucket prev):
        """A reload made this bucket in place of ``prev``: nothing to take over where the
        level lives outside this object (a shared cell or the store keeps it)."""
        pass

    def draw(self, double amount, double need):
        """Draw ``amount`` units if ``need`` are there: 0.0, else the seconds until they
        would be. Never waits."""
        return self.draw_at(amount, need, 0.0)

    def settle(self, double delta):
        """The answer used ``delta`` units more than were drawn (fewer when negative)."""
        self.settle_at(delta, 0.0)

    def left(self):
        """Units left now (below 0: in debt)."""
        return self.left_at(0.0)


cdef class LocalBucket(Bucket):
    """A bucket of this process alone: starts full."""

    def __init__(self, double rate, double cap):
        self.rate = rate
        self.cap = cap
        self.level = cap
        self.stamp = monotonic()

    cdef void _refill(self, double now) noexcept:
        cdef double level = self.level
        if now <= 0.0:
            now = monotonic()
        if now > self.stamp:  # (a time before the last one: no refill, as none is due)
            level = level + (now - self.stamp) * self.rate
            self.stamp = now
        self.level = level if level < self.cap else self.cap

    cdef double draw_at(self, double amount, double need, double now) except -1:
        self._refill(now)
        if self.level >= need:
            self.level -= amount
            return 0.0
        return (need - self.level) / self.rate

    cdef int settle_at(self, double delta, double now) except -1:
        self._refill(now)
        self.level -= delta
        return 0

    cdef double left_at(self, double now) noexcept:
        self._refill(now)
        return self.level

    cpdef take_over(self, Bucket prev):
        """An unchanged limit keeps its level over a reload; a changed one starts full."""
        if type(prev) is LocalBucket and prev.rate == self.rate and prev.cap == self.cap:
            self.level = (<LocalBucket>prev).level
            self.stamp = (<LocalBucket>prev).stamp


cdef class ShmBucket(Bucket):
    """One cell of the workers' shared memory: every worker draws from it (state/shm.pyx).
    A cell whose limits changed (or a new one) starts full, an unchanged one keeps its level."""

    @staticmethod
    cdef ShmBucket of(TenantSlot *slot, bint tokens, double rate, double cap):
        cdef ShmBucket b = ShmBucket.__new__(ShmBucket)
        b.rate = rate
        b.cap = cap
        b.cell = &slot.tok if tokens else &slot.req
        vf_cell_config(b.cell, rate, cap)
        return b

    cdef double draw_at(self, double amount, double need, double now) except -1:
        return vf_cell_draw(self.cell, amount, need)

    cdef int settle_at(self, double delta, double now) except -1:
        vf_cell_settle(self.cell, delta)
        return 0

    cdef double left_at(self, double now) noexcept:
        return vf_cell_left(self.cell)


cdef class StoreBucket(Bucket):
    """This replica's share of one bucket in the state store, and its local fallback.

    ``store`` is told when a refill is due (``ask(bucket)``) and when a settlement is owed
    (``owe(bucket)``); it fills the share from Redis and switches the bucket to its
    fallback while the store is unreachable (state/store.py)."""

    def __init__(self, store, str key, double rate, double cap, double floor):
        self.store = store
        self.key = key
        self.rate = rate
        self.cap = cap
        # The share asked for: about SHARE_S of the rate, at least ``floor`` units and two
        # of the largest draws seen (so one is in hand while the next is fetched), at most
        # the bucket; refilled at half.
        self.chunk = min(cap, max(floor, rate * SHARE_S))
        self.low = self.chunk / 2
        self.need = 0.0
        self.held = 0.0
        self.debt = 0.0
        self.asking = False
        self.not_before = 0.0
        self.shared_level = cap
        self.replicas = 0
        self.room = cap
        self.answered = 0.0
        self.up = False
        self.fallback = LocalBucket(rate, cap)
        self.fallback.level = 0.0
        self.spent = 0.0

    cdef double draw_at(self, double amount, double need, double now) except -1:
        cdef double held, short, level, wait
        if not self.up:
            wait = self.fallback.draw_at(amount, need, now)
            if wait == 0.0:
                self.spent += amount
            return wait
        if need > self.need:
            self._grow(need)
        held = self.held
        if held >= need:
            self.held = held = held - amount
            if held <= self.low and not self.asking:
                self.store.ask(self)
            return 0.0
        if not self.asking:
            self.store.ask(self)
        if self.replicas == 1:
            # Short of its share, and no other replica holds one: the bucket's level is
            # what its last answer said, less what was drawn on it since, plus its refill
            # up to its room, exactly. Drawn from it as a debt, settled with the next round
            # trip (a burst larger than the share is served as a local bucket would serve
            # it). With other replicas that view is stale (they take from the same level),
            # and a draw on it could pass the bucket: they wait for the refill.
            if now <= 0.0:
                now = monotonic()
            level = min(self.room, self.shared_level + (now - self.answered) * self.rate)
            if level + held >= need:
                short = amount - held
                self.shared_level = level - short
                self.answered = now
                self.debt += short
                self.held = 0.0
                self.store.owe(self)
                return 0.0
        return (need - held) / self.rate

    cdef void _grow(self, double need) noexcept:
        self.need = need = min(need, self.cap)
        self.chunk = min(self.cap, max(self.chunk, 2 * need))
        self.low = self.chunk / 2

    cdef int settle_at(self, double delta, double now) except -1:
        cdef double held
        if not self.up:
            self.fallback.settle_at(delta, now)
            self.spent += delta
            return 0
        held = self.held - delta
        if held < 0:  # more than this replica holds: a debt of the shared bucket
            self.debt -= held
            self.shared_level += held
            held = 0.0
            self.store.owe(self)
        elif held > 2 * self.chunk:  # more than it needs: back to the shared bucket
            self.debt -= held - self.chunk
            self.shared_level += held - self.chunk
            held = self.chunk
            self.store.owe(self)
        self.held = held
        return 0

    cdef double left_at(self, double now) noexcept:
        """The shared level at the last answer and this replica's share (the local
        bucket while the store is down)."""
        if not self.up:
            return self.fallback.left_at(now)
        return self.shared_level + self.held

    def to_local(self):
        """The store is down: the local bucket starts from what this replica held, and the
        settlements not sent count as spent."""
        self.up = False
        self.fallback.level = self.held
        self.fallback.stamp = monotonic()
        self.spent = self.debt
        self.held = self.debt = 0.0
        self.asking = False
        self.not_before = 0.0


def make_bucket(str tenant, str kind, double rate, double cap, store=None):
    """A tenant's bucket of ``kind`` ("requests" or "tokens"), where the config puts it:
    in the state store when one is configured (``store``), else in the workers' shared
    memory when this process is a worker, else in this process."""
    cdef TenantSlot *slot
    if store is not None:
        return store.bucket(tenant, kind, rate, cap)
    slot = tenant_slot(tenant)
    if slot != NULL:
        return ShmBucket.of(slot, kind == "tokens", rate, cap)
    return LocalBucket(rate, cap)
