# A token bucket and its three homes, typed (see bucket.pyx).

cimport cython

from velocity_fast.state.shm cimport TenantSlot, vf_cell


cdef class Bucket:
    cdef readonly double rate       # units a second
    cdef readonly double cap        # the bucket's size

    # ``now``: the monotonic clock where the caller has read it, else 0.0 (read only by
    # the homes that need it: a shared cell keeps its own clock, and a clock read costs
    # more than the draw). Draw ``amount`` if ``need`` are there: 0.0, else the seconds until.
    cdef double draw_at(self, double amount, double need, double now) except -1
    cdef int settle_at(self, double delta, double now) except -1
    cdef double left_at(self, double now) noexcept
    cpdef take_over(self, Bucket prev)


@cython.final
cdef class LocalBucket(Bucket):
    cdef public double level        # below 0: in debt
    cdef public double stamp

    cdef void _refill(self, double now) noexcept


@cython.final
cdef class ShmBucket(Bucket):
    cdef vf_cell *cell

    @staticmethod
    cdef ShmBucket of(TenantSlot *slot, bint tokens, double rate, double cap)


@cython.final
cdef class StoreBucket(Bucket):
    cdef public object store
    cdef public str key
    # The share asked for (grows to two of the largest draws), and half of it
    cdef public double chunk
    cdef public double low
    cdef public double need
    # Units granted to this replica, not yet drawn; settlements not yet sent (below 0: a credit)
    cdef public double held
    cdef public double debt
    # A refill queued or in flight
    cdef public bint asking
    # time.monotonic() before which no refill is asked; the bucket's level at the last answer
    cdef public double not_before
    cdef public double shared_level
    # At the last answer: the replicas holding shares (this one too), the most the bucket's
    # level may refill to (its size less every share held), and when it came (monotonic)
    cdef public int replicas
    cdef public double room
    cdef public double answered
    # The store answers (else the local fallback, and what it admitted)
    cdef public bint up
    cdef public LocalBucket fallback
    cdef public double spent

    cdef void _grow(self, double need) noexcept
