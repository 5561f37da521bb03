# State and signatures of the band queues (see bands.pyx for the why).

cdef extern from "admission_consts.h":
    long long VF_REJECT_BAND_COUNT
    long long VF_REJECT_BAND_BYTES
    long long VF_REJECT_GLOBAL_COUNT
    long long VF_REJECT_GLOBAL_BYTES
    long long VF_REJECT_BAD_BAND
    double VF_BYTES_PER_TOKEN


cdef class Item:
    cdef readonly object waiter
    cdef readonly long long id
    cdef readonly object tenant
    cdef readonly int band
    cdef readonly long long nbytes
    cdef readonly double tokens
    cdef readonly double deadline
    cdef readonly double enqueued_at
    cdef readonly double expires_at
    cdef readonly bint queued
    cdef long long seq
    cdef bint indexed        # in BandQueues.items (enqueue's; push's are not)
    # What a grant needs, carried for admission (push)
    cdef public double grant_deadline
    cdef public long max_tokens
    # Token fairness: the estimate charged when it was dispatched, and to whom (its
    # tenant's queue in this band), for the settlement when the answer ends.
    cdef readonly double charged
    cdef readonly TenantQueue charged_to
    cdef public double service   # its expected service when queued (-1: unknown then)
    # Intrusive links: the tenant's FIFO and the band's age (enqueue-order) list.
    cdef Item t_prev
    cdef Item t_next
    cdef Item a_prev
    cdef Item a_next
    cdef TenantQueue owner


# How a queued request's prefix stands: the fraction of its prompt an engine with room
# holds, 0 to 1. Told to each BandQueues by whoever makes it (admission, from the gateway:
# Admission.set_locality; ``locality_from_waiters`` for waiters that say it themselves).
ctypedef double (*locality_fn)(object waiter) except? -1.0

# Fairness between the tenants of a band.
cdef enum:
    FAIR_RR = 0
    FAIR_TOKENS = 1
    FAIR_LOCALITY = 2


from velocity_fast.state.shm cimport FairCounter


cdef class TenantQueue:
    cdef readonly object name
    cdef readonly Py_ssize_t count
    cdef readonly double vtc
    # Of vtc: what is charged to answers not ended yet (estimates), and what lifts added
    cdef readonly double pending
    cdef readonly double lifted
    cdef readonly double weight   # its share in fairness (the tenant's configured weight)
    cdef double inv_weight        # 1 / weight: what a served token adds to vtc
    cdef double quantum           # turns a visit adds: weight / the smallest weight (at most 1)
    cdef double credit            # turns left in the current visit (weighted round-robin)
    cdef Item head
    cdef Item tail
    cdef list heap
    cdef bint active
    cdef TenantQueue r_prev
    cdef TenantQueue r_next
    # Workers: the counter, its pending part and its lifts as every worker charges them
    # (state/shm.pxd; NULLs: one process)
    cdef FairCounter shm


cdef class BandQueue:
    cdef readonly int index
    cdef readonly Py_ssize_t count
    cdef readonly long long nbytes
    cdef readonly Py_ssize_t capacity
    cdef readonly long long byte_capacity
    cdef readonly double ttl
    cdef readonly Py_ssize_t active_tenants
    cdef readonly int mode        # FAIR_RR, FAIR_TOKENS or FAIR_LOCALITY
    cdef dict tenants
    cdef TenantQueue cursor
    cdef Item age_head
    cdef Item age_tail


cdef class BandQueues:
    cdef readonly int nbands
    cdef readonly Py_ssize_t count
    cdef readonly long long nbytes
    cdef readonly Py_ssize_t capacity
    cdef readonly long long byte_capacity
    cdef readonly bint edf
    cdef readonly bint token_fair
    cdef readonly double aging_step
    cdef dict _weights            # tenant -> weight; read when a tenant's queue is made
    cdef double _quantum_scale    # 1 / the smallest weight (weight 1 if none is smaller)
    cdef readonly double out_weight   # token fairness: an output token costs this many input tokens
    cdef readonly double locality_bound  # locality: how far past the least counter a tenant may be preferred
    cdef locality_fn locality     # how a waiter's prefix stands (NULL: not known; locality then ranks by counter)
    cdef list bands
    cdef dict items
    cdef long long next_id
    cdef long long seq

    cpdef long long enqueue(self, object waiter, object tenant, int band,
                            long long nbytes, double tokens, double deadline,
                            double now) except? -100
    cdef Item push(self, object waiter, object tenant, int band, long long nbytes, double tokens,
                   double deadline, double now, long long* code)
    cpdef Item pop(self, int band, double now)
    cpdef Item aged_head(self, int band, double now)
    cpdef Item pop_own(self, int band)
    cpdef Py_ssize_t count_through(self, int band)
    cdef bint holds(self, Item it)
    cpdef Item cancel(self, long long item_id)
    cpdef list expire(self, double now)
    cpdef list pop_hopeless(self, double now, double base_s, double per_token_s)
    cpdef int effective_band(self, Item item, double now)
    cdef Item _pop_aged(self, int band, double now)
    cdef Item _pop_fair(self, BandQueue bq)
    cdef void _activate(self, BandQueue bq, TenantQueue t)
    cdef void _lift(self, TenantQueue t, double by) noexcept
    cdef void _deactivate(self, BandQueue bq, TenantQueue t)
    cdef void remove(self, Item it) except *
    cdef double estimate(self, long long nbytes, double tokens) noexcept
    cdef bint counted(self, int band) noexcept
    cdef TenantQueue _pick_local(self, BandQueue bq, TenantQueue low)
    cdef TenantQueue charge(self, int band, object tenant, double cost)
    cdef void settle(self, TenantQueue t, double charged, double actual) noexcept
