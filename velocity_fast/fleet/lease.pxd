# A lease of a bucket shared through the state store, typed (see lease.pyx).

cdef class SharedBucket:
    cdef public object store
    cdef public str key
    cdef public double rate
    cdef public double cap
    # The lease asked for (grows to two of the largest draws), and half of it
    cdef public double chunk
    cdef public double low
    cdef public double need
    # Units granted to this replica, not yet drawn; settlements not yet sent (below 0: a credit)
    cdef public double lease
    cdef public double debt
    # A refill queued or in flight
    cdef public bint asking
    # time.monotonic() before which no refill is asked; the bucket's level at the last answer
    cdef public double not_before
    cdef public double shared_level
    # At the last answer: the replicas holding leases (this one too), the most the bucket's
    # level may refill to (its size less every lease held), and when it came (monotonic)
    cdef public int replicas
    cdef public double room
    cdef public double answered
    # The store answers (else the local fallback: its level, its time, what it admitted)
    cdef public bint up
    cdef public double level
    cdef public double stamp
    cdef public double spent

    cpdef double draw(self, double amount, double need) except -1
    cpdef settle(self, double delta)
    cdef void _grow(self, double need) noexcept
    cdef void _refill_local(self) noexcept
    cdef double _draw_local(self, double amount, double need) noexcept
