"""Priority bands of per-tenant queues: the registry of admission.

Layout, per band: one queue per tenant and a ring of the tenants that have work.
Between tenants the band picks by turns (round-robin: a tenant with a thousand
requests takes one slot in the rotation) or by a virtual token counter (the tenant
that was served the fewest tokens goes next, so long requests cannot take more than
their share). Within a tenant the order is FIFO, or earliest deadline first.

The counter follows VTC (Sheng et al., OSDI 2024): a tenant whose queue goes from empty
to non-empty is lifted to the least counter among the backlogged ones; the least counter
is served next; a request costs its input tokens plus ``out_weight`` (default 2) times
its output tokens. It is charged the estimate (body bytes / 4 plus ``max_tokens``, which
for a request that named none is its pool's learned reply length) when it is dispatched,
queued or not (``charge`` for a request granted at once), and the caller settles the
difference (``settle``) once the engine said what it served.

A lift compares what was served, not what is charged: the others' counters are taken
without their part still charged to answers in flight (``pending``: estimates, often far
above what the engine will serve). Lifted to another's estimates, a tenant would keep
them for good while the other's settle back down, and lose that much at every lift. The
returning tenant's own answers in flight count as served: its queue may empty while they
wait in an engine's queue, and it is behind by at most them. What
lifts added is kept (``lifted``): a counter is its tenant's weighted service plus that,
plus what is pending.

A tenant's weight is its share: by turns, a visit of the rotation lasts ``weight``
requests (deficit round-robin: a fraction carries over to the next visit; weights are
scaled so that the smallest is 1, so that a visit never ends without a turn); by tokens,
a served token adds ``1 / weight`` to its counter. Of two backlogged tenants, the one
of weight 2 is served twice as often (or twice the tokens) as the one of weight 1.
The weight is read once, when the tenant's queue in a band is made, and kept there.

Every item also sits on its band's age list (enqueue order). Since a band has one
TTL, the head of that list is both the oldest item and the first to expire, which
makes TTL expiry and anti-starvation aging O(1) per item. Items are linked
intrusively, so cancelling one by id is O(1); in EDF mode the tenant's heap keeps
cancelled items until they surface (lazy deletion), and counts drop at once.

Nothing here knows asyncio: an item carries an opaque waiter for the caller.
"""

cimport cython
from libc.math cimport INFINITY, floor

from velocity_fast.state.shm cimport fair_add, fair_counter, fair_load, fair_raise

REJECT_BAND_COUNT = VF_REJECT_BAND_COUNT
REJECT_BAND_BYTES = VF_REJECT_BAND_BYTES
REJECT_GLOBAL_COUNT = VF_REJECT_GLOBAL_COUNT
REJECT_GLOBAL_BYTES = VF_REJECT_GLOBAL_BYTES
REJECT_BAD_BAND = VF_REJECT_BAD_BAND
BYTES_PER_TOKEN = VF_BYTES_PER_TOKEN

FAIRNESS_MODES = {"rr": FAIR_RR, "tokens": FAIR_TOKENS, "locality": FAIR_LOCALITY}

# Locality looks at this many tenants at most (those within the bound, from the turn
# on): each look asks the prefix index, and a band may hold thousands of tenants.
cdef int _LOCALITY_SCAN = 16


cdef double _waiter_says(object waiter) except? -1.0:
    """A waiter's own ``prefix_cached()`` (BandQueues.locality_from_waiters)."""
    return <double>waiter.prefix_cached()


# A visit of the rotation goes on while this much credit is left: one whole turn, less
# what summing fractional weights loses to rounding (ten visits of 0.1 make a turn).
cdef double _WHOLE = 1.0 - 1e-9


# Items come and go at request rate: recycle their memory instead of asking the
# allocator each time.
@cython.freelist(1024)
cdef class Item:
    """One queued request: the caller's waiter plus what scheduling needs."""

    def __repr__(self):
        return (f"Item(id={self.id}, tenant={self.tenant!r}, band={self.band}, "
                f"nbytes={self.nbytes}, tokens={self.tokens}, queued={self.queued})")


cdef class TenantQueue:
    """The queue of one tenant inside one band."""

    def __cinit__(self, object name, double weight=1.0, double quantum_scale=1.0):
        self.name = name
        self.heap = []
        if not (weight > 0 and weight < INFINITY):
            raise ValueError(f"weight of tenant {name!r}: must be a positive number, got {weight!r}")
        self.weight = weight
        self.inv_weight = 1.0 / weight
        self.quantum = weight * quantum_scale


cdef class BandQueue:
    """One band: its tenants, its age list, its counts and limits."""

    def __cinit__(self, int index, Py_ssize_t capacity, long long byte_capacity, double ttl):
        self.index = index
        self.capacity = capacity
        self.byte_capacity = byte_capacity
        self.ttl = ttl
        self.tenants = {}

    @property
    def oldest_enqueued_at(self):
        """Enqueue time of the oldest queued item, or None when empty."""
        return None if self.age_head is None else self.age_head.enqueued_at


cdef inline bint _earlier(Item a, Item b):
    if a.deadline != b.deadline:
        return a.deadline < b.deadline
    return a.seq < b.seq


cdef inline void _heap_push(list heap, Item it):
    cdef Py_ssize_t i, parent
    cdef Item p
    heap.append(it)
    i = len(heap) - 1
    while i > 0:
        parent = (i - 1) >> 1
        p = <Item>heap[parent]
        if not _earlier(it, p):
            break
        heap[i] = p
        i = parent
    heap[i] = it


cdef inline Item _heap_pop(list heap):
    cdef Item last = <Item>heap.pop()
    cdef Py_ssize_t n = len(heap)
    cdef Py_ssize_t i = 0, c
    cdef Item top
    if n == 0:
        return last
    top = <Item>heap[0]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _earlier(<Item>heap[c + 1], <Item>heap[c]):
            c += 1
        if not _earlier(<Item>heap[c], last):
            break
        heap[i] = heap[c]
        i = c
    heap[i] = last
    return top




cdef inline void _vtc_add(TenantQueue t, double d) noexcept:
    """Add to a tenant's counter; with workers, to every worker's one."""
    fair_add(t.shm.vtc, &t.vtc, d)


cdef inline void _pend_add(TenantQueue t, double d) noexcept:
    """Add to what of a tenant's counter answers in flight hold (every worker's)."""
    fair_add(t.shm.pend, &t.pending, d)


cdef inline double _served(TenantQueue t) noexcept:
    """A tenant's counter without what answers in flight hold: what lifts compare."""
    return fair_load(t.shm.vtc, &t.vtc) - fair_load(t.shm.pend, &t.pending)


cdef inline double _vtc(TenantQueue t) noexcept:
    """A tenant's counter now (with workers: as the others charged it too)."""
    return fair_load(t.shm.vtc, &t.vtc)


cdef class BandQueues:
    """All bands of one admission controller.

    ``bands`` is a list of ``(queue_capacity, queue_bytes, ttl_s)`` tuples, highest
    priority first (index 0); ``queue_bytes`` <= 0 means no byte limit, ``ttl_s``
    <= 0 means no TTL. ``capacity``/``byte_capacity`` bound all bands together
    (<= 0: unbounded). ``edf`` orders a tenant's items by deadline instead of
    arrival; ``token_fair`` picks tenants by virtual token counter instead of by
    turns; ``aging_step`` (seconds, <= 0: off) raises an item's effective band by
    one for every step it has waited. ``weights`` maps a tenant to its share in
    fairness (a positive number; a tenant not in it has weight 1). ``out_weight``:
    what an output token costs in input tokens, for the token counter. ``modes``: per
    band, "rr", "tokens" or "locality" (None: every band "tokens" when ``token_fair``,
    else "rr"); ``locality_bound``: how far (in counter units) past the least-served
    tenant's counter a tenant whose request's prefix is cached may be served first.
    """

    def __cinit__(self, list bands, Py_ssize_t capacity=0, long long byte_capacity=0,
                  bint edf=False, bint token_fair=False, double aging_step=0.0,
                  dict weights=None, double out_weight=2.0, list modes=None, double locality_bound=0.0):
        cdef int i
        cdef double w
        cdef BandQueue bq
        if not bands:
            raise ValueError("at least one band is required")
        if not (out_weight >= 0 and out_weight < INFINITY):
            raise ValueError(f"out_weight: must be a finite number >= 0, got {out_weight!r}")
        self.out_weight = out_weight
        self._weights = {}
        low = 1.0
        for name, value in (weights or {}).items():
            w = value
            if not (w > 0 and w < INFINITY):
                raise ValueError(f"weight of tenant {name!r}: must be a positive number, got {value!r}")
            if w != 1.0:
                self._weights[name] = w
            if w < low:
                low = w
        # By turns, the smallest weight is one turn a visit: shares keep their ratios, and
        # no visit passes without a turn (else a tenant of weight 0.001 would take a
        # thousand rotations of the ring to be served once).
        self._quantum_scale = 1.0 / low
        if modes is not None and len(modes) != len(bands):
            raise ValueError(f"modes: one per band ({len(bands)}), got {len(modes)}")
        if not (locality_bound >= 0 and locality_bound < INFINITY):
            raise ValueError(f"locality_bound: must be a finite number >= 0, got {locality_bound!r}")
        self.locality_bound = locality_bound
        self.bands = []
        for i, spec in enumerate(bands):
            cap, nbytes, ttl = spec
            bq = BandQueue(i, cap, nbytes, ttl)
            if modes is None:
                bq.mode = FAIR_TOKENS if token_fair else FAIR_RR
            elif modes[i] in FAIRNESS_MODES:
                bq.mode = FAIRNESS_MODES[modes[i]]
            else:
                raise ValueError(f"modes[{i}]: 'rr', 'tokens' or 'locality', not {modes[i]!r}")
            if bq.mode != FAIR_RR:
                token_fair = True
            self.bands.append(bq)
        self.nbands = len(self.bands)
        self.capacity = capacity
        self.byte_capacity = byte_capacity
        self.edf = edf
        self.token_fair = token_fair
        self.aging_step = aging_step
        self.items = {}
        self.next_id = 1

    def __len__(self):
        return self.count

    def band(self, int index):
        """The BandQueue at ``index`` (0 = highest)."""
        return self.bands[index]

    @property
    def weights(self):
        """Tenant -> weight, for the tenants whose weight is not 1 (a copy)."""
        return dict(self._weights)

    def weight_of(self, tenant):
        """The share of ``tenant`` in fairness (1.0 unless ``weights`` said otherwise)."""
        return self._weights.get(tenant, 1.0)

    def tenant_queue(self, int band, tenant):
        """The TenantQueue of ``tenant`` in ``band``, or None if it never queued there."""
        return (<BandQueue>self.bands[band]).tenants.get(tenant)

    def get(self, long long item_id):
        """The queued item with this id (one ``enqueue`` queued), or None."""
        return self.items.get(item_id)

    cpdef Py_ssize_t count_through(self, int band):
        """Items queued in bands 0..``band`` (this band and every higher one)."""
        cdef Py_ssize_t n = 0
        cdef int b
        if band >= self.nbands:
            band = self.nbands - 1
        for b in range(band + 1):
            n += (<BandQueue>self.bands[b]).count
        return n

    def __iter__(self):
        """Queued items, band by band, oldest first (a snapshot)."""
        cdef BandQueue bq
        cdef Item it
        out = []
        for bq in self.bands:
            it = bq.age_head
            while it is not None:
                out.append(it)
                it = it.a_next
        return iter(out)

    cpdef long long enqueue(self, object waiter, object tenant, int band,
                            long long nbytes, double tokens, double deadline,
                            double now) except? -100:
        """Queue one item; return its id (> 0) or a negative REJECT_* code."""
        cdef long long code
        cdef Item it = self.push(waiter, tenant, band, nbytes, tokens, deadline, now, &code)
        if it is not None:
            it.indexed = True
            self.items[it.id] = it
        return code

    cdef Item push(self, object waiter, object tenant, int band, long long nbytes, double tokens,
                   double deadline, double now, long long* code):
        """enqueue for a caller that keeps the Item (admission): not indexed by id (no
        dict entry, no int object), taken back with ``remove``. None when refused,
        ``code`` set to the REJECT_* code; else ``code`` is the item's id."""
        cdef BandQueue bq
        cdef TenantQueue t
        cdef Item it
        if band < 0 or band >= self.nbands:
            code[0] = VF_REJECT_BAD_BAND
            return None
        bq = <BandQueue>self.bands[band]
        if bq.capacity > 0 and bq.count >= bq.capacity:
            code[0] = VF_REJECT_BAND_COUNT
            return None
        if bq.byte_capacity > 0 and bq.nbytes + nbytes > bq.byte_capacity:
            code[0] = VF_REJECT_BAND_BYTES
            return None
        if self.capacity > 0 and self.count >= self.capacity:
            code[0] = VF_REJECT_GLOBAL_COUNT
            return None
        if self.byte_capacity > 0 and self.nbytes + nbytes > self.byte_capacity:
            code[0] = VF_REJECT_GLOBAL_BYTES
            return None

        it = Item.__new__(Item)
        it.waiter = waiter
        it.id = self.next_id
        self.next_id += 1
        it.tenant = tenant
        it.band = band
        it.nbytes = nbytes
        it.tokens = tokens
        it.deadline = deadline
        it.enqueued_at = now
        it.expires_at = now + bq.ttl if bq.ttl > 0 else INFINITY
        it.seq = self.seq
        self.seq += 1
        it.queued = True

        t = <TenantQueue>bq.tenants.get(tenant)
        if t is None:
            # Once per tenant and band: the queue keeps its weight from then on.
            t = TenantQueue(tenant, self._weights.get(tenant, 1.0) if self._weights else 1.0,
                            self._quantum_scale)
            bq.tenants[tenant] = t
            if bq.mode != FAIR_RR:  # with workers, one counter for all of them
                t.shm = fair_counter(tenant, band)
        it.owner = t
        if self.edf:
            _heap_push(t.heap, it)
        else:
            it.t_prev = t.tail
            if t.tail is None:
                t.head = it
            else:
                t.tail.t_next = it
            t.tail = it
        t.count += 1
        if not t.active:
            self._activate(bq, t)

        it.a_prev = bq.age_tail
        if bq.age_tail is None:
            bq.age_head = it
        else:
            bq.age_tail.a_next = it
        bq.age_tail = it

        bq.count += 1
        bq.nbytes += nbytes
        self.count += 1
        self.nbytes += nbytes
        code[0] = it.id
        return it

    cpdef int effective_band(self, Item item, double now):
        """The band the item competes in at ``now``, after aging."""
        cdef int raised
        if self.aging_step <= 0:
            return item.band
        raised = <int>floor((now - item.enqueued_at) / self.aging_step)
        return item.band - raised if raised < item.band else 0

    cpdef Item pop(self, int band, double now):
        """Remove and return the next item eligible for ``band`` at ``now``.

        Items aged up from a lower band go first (they have waited the longest),
        then the band's own items by tenant fairness. None when nothing is eligible.
        """
        cdef Item it
        if band < 0 or band >= self.nbands:
            return None
        if self.aging_step > 0:
            it = self._pop_aged(band, now)
            if it is not None:
                return it
        return self._pop_fair(<BandQueue>self.bands[band])

    cpdef Item aged_head(self, int band, double now):
        """The item ``pop(band, now)`` would take from a lower band (aged up), left in
        place; None when it would take one of the band's own."""
        cdef int lower
        cdef Item head, best = None
        if self.aging_step <= 0 or band < 0 or band >= self.nbands:
            return None
        for lower in range(band + 1, self.nbands):
            head = (<BandQueue>self.bands[lower]).age_head
            if head is not None and self.effective_band(head, now) <= band:
                if best is None or head.seq < best.seq:
                    best = head
        return best

    cpdef Item pop_own(self, int band):
        """Remove and return the next of the band's own items (none aged up), by tenant
        fairness; None when it has none."""
        if band < 0 or band >= self.nbands:
            return None
        return self._pop_fair(<BandQueue>self.bands[band])

    cdef Item _pop_aged(self, int band, double now):
        cdef int lower
        cdef Item head, best = None
        for lower in range(band + 1, self.nbands):
            # The age head is the oldest of its band: if it has not aged enough,
            # no item of that band has.
            head = (<BandQueue>self.bands[lower]).age_head
            if head is not None and self.effective_band(head, now) <= band:
                if best is None or head.seq < best.seq:
                    best = head
        if best is not None:
            self.remove(best)
        return best

    cdef Item _pop_fair(self, BandQueue bq):
        cdef TenantQueue t, c
        cdef Item it
        if bq.cursor is None:
            return None
        t = bq.cursor
        if bq.mode != FAIR_RR:
            _vtc(t)
            c = t.r_next
            while c is not bq.cursor:
                if _vtc(c) < t.vtc:
                    t = c
                c = c.r_next
            if bq.mode == FAIR_LOCALITY and self.locality != NULL and t.r_next is not t:
                t = self._pick_local(bq, t)
            # Move the turn past the chosen tenant (ties rotate).
            bq.cursor = t.r_next
        elif not self._weights:
            bq.cursor = t.r_next  # every weight 1: one request per visit, no credit kept
        else:
            # A visit starts by adding the tenant's quantum to its credit and lasts while a
            # whole turn is left (a fraction carries over). Every quantum is at least one
            # turn, so the first tenant visited serves. With every weight 1 this is plain
            # round-robin: one request per visit.
            while t.credit < _WHOLE:
                t.credit += t.quantum
                if t.credit < _WHOLE:
                    t = t.r_next
            t.credit -= 1.0
            bq.cursor = t if t.credit >= _WHOLE else t.r_next
        if self.edf:
            it = _heap_pop(t.heap)
            while not it.queued:
                it = _heap_pop(t.heap)
        else:
            it = t.head
        if bq.mode != FAIR_RR:
            it.charged = self.estimate(it.nbytes, it.tokens)
            it.charged_to = t
            _vtc_add(t, it.charged * t.inv_weight)
            _pend_add(t, it.charged * t.inv_weight)
        self.remove(it)
        return it

    cdef TenantQueue _pick_local(self, BandQueue bq, TenantQueue low):
        """Locality: among the tenants whose counter is within ``locality_bound`` of the
        least one (``low``), the one whose next request's prefix an engine with room
        holds the most of; ``low`` when none holds any. Fairness then holds within the
        bound, and a tenant's prefix is served where it is cached while it lasts."""
        cdef TenantQueue c = bq.cursor, best = low
        cdef double limit = low.vtc + self.locality_bound, score, top = 0.0
        cdef int seen = 0
        cdef Item head
        while True:
            if c.vtc <= limit:
                head = c.head if not self.edf else (<Item>c.heap[0] if c.heap else None)
                if head is not None and head.queued:
                    score = self.locality(head.waiter)
                    if score > top or (score == top and score > 0 and c.vtc < best.vtc):
                        top = score
                        best = c
                seen += 1
                if seen >= _LOCALITY_SCAN:
                    break
            c = c.r_next
            if c is bq.cursor:
                break
        return best

    cdef bint counted(self, int band) noexcept:
        """The band's tenants are served by token counter (tokens or locality)."""
        return (<BandQueue>self.bands[band]).mode != FAIR_RR

    def locality_from_waiters(self):
        """Locality asks each waiter its ``prefix_cached()`` (the fraction of its prompt an
        engine with room holds): for waiters that know it themselves (tests, tools); the
        gateway's queues ask its router instead (Admission.set_locality)."""
        self.locality = _waiter_says

    def fairness_of(self, int band):
        """The band's fairness: "rr", "tokens" or "locality"."""
        return ("rr", "tokens", "locality")[(<BandQueue>self.bands[band]).mode]

    cdef double estimate(self, long long nbytes, double tokens) noexcept:
        """What a request is charged before the engine says: its body in tokens (bytes /
        4) plus ``out_weight`` times the output tokens it asks for."""
        return nbytes / VF_BYTES_PER_TOKEN + self.out_weight * tokens

    cdef TenantQueue charge(self, int band, object tenant, double cost):
        """Charge ``cost`` to ``tenant``'s counter in ``band`` (a request dispatched
        without queueing); returns its queue, made (empty) if it had none."""
        cdef BandQueue bq = <BandQueue>self.bands[band]
        cdef TenantQueue t = <TenantQueue>bq.tenants.get(tenant)
        if t is None:
            t = TenantQueue(tenant, self._weights.get(tenant, 1.0) if self._weights else 1.0,
                            self._quantum_scale)
            bq.tenants[tenant] = t
            t.shm = fair_counter(tenant, band)
        _vtc_add(t, cost * t.inv_weight)
        _pend_add(t, cost * t.inv_weight)
        return t

    cdef void settle(self, TenantQueue t, double charged, double actual) noexcept:
        """The answer charged ``charged`` ended: it cost ``actual`` (the engine's usage; 0
        when it was never served; below 0: unknown, the estimate stands)."""
        if actual >= 0.0:
            _vtc_add(t, (actual - charged) * t.inv_weight)
        _pend_add(t, -charged * t.inv_weight)

    def charge_tenant(self, int band, tenant, double cost):
        """``charge`` from Python (tests): the tenant's counter after it."""
        return self.charge(band, tenant, cost).vtc

    def settle_tenant(self, int band, tenant, double charged, double actual):
        """``settle`` from Python (tests): the tenant's counter after it."""
        cdef TenantQueue t = (<BandQueue>self.bands[band]).tenants[tenant]
        self.settle(t, charged, actual)
        return _vtc(t)

    def tenant_snapshot(self):
        """Per band, per tenant: (counter, queued, pending, lifted) for /stats; a tenant
        whose queue in a band was made (it was queued or charged there) is listed."""
        cdef BandQueue bq
        cdef TenantQueue t
        out = []
        for bq in self.bands:
            out.append({name: (_vtc(t), t.count, fair_load(t.shm.pend, &t.pending), fair_load(t.shm.lift, &t.lifted))
                        for name, t in bq.tenants.items()})
        return out

    cdef void _activate(self, BandQueue bq, TenantQueue t):
        cdef TenantQueue c
        cdef double least, v
        if bq.cursor is None:
            t.r_next = t
            t.r_prev = t
            bq.cursor = t
        else:
            if bq.mode != FAIR_RR:
                # A returning tenant starts level with the least-served active one,
                # so time spent idle is not banked as credit (VTC's lift). Served, not
                # charged: the others' estimates in flight are not service. Its own
                # count as served: a tenant whose queue emptied while its requests run
                # (they may wait in an engine's queue) is behind by at most those.
                c = bq.cursor
                least = _served(c)
                c = c.r_next
                while c is not bq.cursor:
                    v = _served(c)
                    if v < least:
                        least = v
                    c = c.r_next
                v = _vtc(t)
                if v < least:
                    self._lift(t, least - v)
            # Insert just behind the cursor: the newcomer waits one full turn.
            c = bq.cursor.r_prev
            t.r_prev = c
            t.r_next = bq.cursor
            c.r_next = t
            bq.cursor.r_prev = t
        t.active = True
        bq.active_tenants += 1

    cdef void _lift(self, TenantQueue t, double by) noexcept:
        # Raised, not added: another worker may have lifted it meanwhile.
        cdef double was = fair_load(t.shm.vtc, &t.vtc)
        if fair_raise(t.shm.vtc, &t.vtc, was + by) > was:
            fair_add(t.shm.lift, &t.lifted, t.vtc - was)

    cdef void _deactivate(self, BandQueue bq, TenantQueue t):
        if t.r_next is t:
            bq.cursor = None
        else:
            t.r_prev.r_next = t.r_next
            t.r_next.r_prev = t.r_prev
            if bq.cursor is t:
                bq.cursor = t.r_next
        t.r_next = None
        t.r_prev = None
        t.active = False
        t.credit = 0.0  # an emptied queue keeps no turns for later (deficit round-robin)
        bq.active_tenants -= 1
        # Heap entries left are cancelled items: drop them with the last live one.
        if t.heap:
            t.heap = []

    cdef void remove(self, Item it) except *:
        cdef BandQueue bq = <BandQueue>self.bands[it.band]
        cdef TenantQueue t = it.owner
        it.queued = False
        if it.indexed:
            it.indexed = False
            del self.items[it.id]
        if it.a_prev is None:
            bq.age_head = it.a_next
        else:
            it.a_prev.a_next = it.a_next
        if it.a_next is None:
            bq.age_tail = it.a_prev
        else:
            it.a_next.a_prev = it.a_prev
        it.a_prev = None
        it.a_next = None
        if not self.edf:
            if it.t_prev is None:
                t.head = it.t_next
            else:
                it.t_prev.t_next = it.t_next
            if it.t_next is None:
                t.tail = it.t_prev
            else:
                it.t_next.t_prev = it.t_prev
            it.t_prev = None
            it.t_next = None
        t.count -= 1
        if t.count == 0:
            self._deactivate(bq, t)
        it.owner = None
        bq.count -= 1
        bq.nbytes -= it.nbytes
        self.count -= 1
        self.nbytes -= it.nbytes

    cdef bint holds(self, Item it):
        """``it`` waits in these queues (push's items, whose ids are not indexed)."""
        cdef BandQueue bq
        if not it.queued or it.band < 0 or it.band >= self.nbands:
            return False
        bq = <BandQueue>self.bands[it.band]
        return it.owner is not None and bq.tenants.get(it.owner.name) is it.owner

    cpdef Item cancel(self, long long item_id):
        """Remove the item with this id at once; return it, or None if not queued."""
        cdef Item it = <Item>self.items.get(item_id)
        if it is None:
            return None
        self.remove(it)
        return it

    cpdef list expire(self, double now):
        """Remove and return every item whose TTL has passed at ``now``."""
        cdef list out = []
        cdef BandQueue bq
        cdef Item it
        for bq in self.bands:
            it = bq.age_head
            while it is not None and it.expires_at <= now:
                self.remove(it)
                out.append(it)
                it = bq.age_head
        return out

    cpdef list pop_hopeless(self, double now, double base_s, double per_token_s):
        """Remove and return items that cannot finish by their deadline.

        An item is hopeless when ``now + base_s + tokens * per_token_s`` is past
        its deadline (``base_s``: the best expected wait + time to first token).
        """
        cdef list out = []
        cdef BandQueue bq
        cdef Item it, nxt
        for bq in self.bands:
            it = bq.age_head
            while it is not None:
                nxt = it.a_next
                if now + base_s + it.tokens * per_token_s > it.deadline:
                    self.remove(it)
                    out.append(it)
                it = nxt
        return out
