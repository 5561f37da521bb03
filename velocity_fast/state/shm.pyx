"""The state the gateway's worker processes share in memory (``--workers N``), compiled.

One memory segment (a file under /dev/shm), made by the supervisor before it starts the
workers and mapped by each (``attach``). What must be global lives there, updated with
atomic operations from the compiled request path: no lock and no extra hop per request
(csrc/shared_state.h has the layout and the operations):

* per endpoint: the requests in flight from every worker (admission's ``Endpoint.inflight``
  is this total; a bind claims a slot below the limit with one compare-and-swap), each
  worker's concurrency limit (the smallest holds), the learned batch;
* per pool: the reservations, every worker's grants not yet released (a grant reserves
  one within the pool's limits, so that the bind that follows finds an engine with room),
  and each worker's queue depth per band (a lower band does not overtake a higher one
  queued in another worker);
* per tenant: its request and token buckets, one cell each (state/bucket.pyx's
  ShmBucket), and its fairness counters per band.

Other modules hold a slot and use the typed functions of shm.pxd, never the raw
operations.

Each worker's part of a count is kept beside the total: when a worker dies the
supervisor gives back what it held (``SharedState.reclaim``). One process (no
``attach``) shares nothing and pays nothing: every slot is NULL.
"""

import os

from libc.stdint cimport int64_t

cdef extern from "shared_state.h":
    int VF_EP_SLOTS
    int VF_POOL_SLOTS
    int VF_TENANT_SLOTS
    int VF_NAME
    vf_shm *vf_map(const char *path, int create, int64_t workers) nogil
    void vf_unmap(vf_shm *s) nogil
    int64_t vf_slot(char *base, size_t stride, int64_t n, const char *name, size_t length) nogil
    int64_t vf_reclaim(vf_shm *s, int w, int64_t *reserved) nogil
    void vf_store "VF_STORE"(int64_t *p, int64_t v) nogil
    int64_t vf_add "VF_ADD"(int64_t *p, int64_t v) nogil
    # Field addresses, as the header lays them out
    int64_t *vf_mine_at(EndpointSlot *e, int w) nogil
    int64_t *vf_queued_at(PoolSlot *p, int w, int b) nogil
    int64_t *vf_limit_at(EndpointSlot *e, int w) nogil
    EndpointSlot *vf_eps(vf_shm *s) nogil
    PoolSlot *vf_pools(vf_shm *s) nogil
    TenantSlot *vf_tenants(vf_shm *s) nogil
    int64_t *vf_restarts(vf_shm *s) nogil
    int64_t *vf_lost(vf_shm *s) nogil
    int vf_key_named(void *slot) nogil
    const char *vf_key_name(void *slot) nogil

__all__ = ["SharedState", "attach", "detach", "attached"]

cdef vf_shm *_shm = NULL
cdef int _worker = -1
cdef SharedState _state = None


cdef class SharedState:
    """The segment, as the supervisor and the workers hold it."""

    def __dealloc__(self):
        if self.shm != NULL and self is not _state:
            vf_unmap(self.shm)
            self.shm = NULL

    @staticmethod
    def create(str path, int workers):
        """Make the segment at ``path`` for ``workers`` workers (a fresh one, zeroed)."""
        cdef SharedState s = SharedState.__new__(SharedState)
        if not 1 <= workers <= VF_MAX_WORKERS:
            raise ValueError(f"workers: from 1 to {VF_MAX_WORKERS}")
        s.shm = vf_map(os.fsencode(path), 1, workers)
        if s.shm == NULL:
            raise OSError(f"cannot make the shared state at {path}")
        s.path = path
        s.owner = True
        return s

    @staticmethod
    def open(str path):
        """Map the segment a supervisor made at ``path``."""
        cdef SharedState s = SharedState.__new__(SharedState)
        s.shm = vf_map(os.fsencode(path), 0, 0)
        if s.shm == NULL:
            raise OSError(f"no shared state at {path}")
        s.path = path
        return s

    @property
    def workers(self):
        return self.shm.workers if self.shm != NULL else 0

    def reclaim(self, int worker):
        """Give back what ``worker`` held (it exited): its requests in flight on each
        engine, its pool reservations, its queue depths, its limits. Returns what was
        given back."""
        cdef int64_t reserved = 0, lost
        if self.shm == NULL or not 0 <= worker < self.shm.workers:
            raise ValueError(f"no worker {worker}")
        lost = vf_reclaim(self.shm, worker, &reserved)
        vf_add(vf_restarts(self.shm), 1)
        vf_add(vf_lost(self.shm), lost)
        return {"inflight": lost, "reserved": reserved}

    def snapshot(self):
        """What the segment holds now: per endpoint its requests in flight (every
        worker's, and each one's), limit, learned batch and binds past a limit; per pool
        its reservations, the reservations it refused (full) and queue depths; per tenant
        its buckets' levels."""
        cdef EndpointSlot *e
        cdef PoolSlot *p
        cdef TenantSlot *t
        cdef int i, w, b, n
        if self.shm == NULL:
            return {}
        n = self.shm.workers
        eps, pools, tenants = {}, {}, {}
        for i in range(VF_EP_SLOTS):
            e = vf_eps(self.shm) + i
            if vf_key_named(e):
                eps[vf_key_name(e).decode()] = {
                    "inflight": vf_load(&e.inflight),
                    "per_worker": [vf_load(vf_mine_at(e, w)) for w in range(n)],
                    "limit": vf_ep_limit(e, n), "batch": vf_ep_cap(e), "overcommits": vf_load(&e.overcommits)}
        for i in range(VF_POOL_SLOTS):
            p = vf_pools(self.shm) + i
            if vf_key_named(p):
                pools[vf_key_name(p).decode()] = {
                    "reserved": vf_load(&p.committed), "refused": vf_load(&p.refused),
                    "queued": [sum(vf_load(vf_queued_at(p, w, b)) for w in range(n)) for b in range(VF_MAX_BANDS)]}
        for i in range(VF_TENANT_SLOTS):
            t = vf_tenants(self.shm) + i
            if vf_key_named(t):
                tenants[vf_key_name(t).decode()] = {
                    "requests_left": vf_cell_left(&t.req) if t.req.rate > 0 else None,
                    "tokens_left": vf_cell_left(&t.tok) if t.tok.rate > 0 else None}
        return {"workers": n, "restarts": vf_load(vf_restarts(self.shm)), "lost": vf_load(vf_lost(self.shm)),
                "endpoints": eps, "pools": pools, "tenants": tenants}

    def close(self):
        if self.shm != NULL and self is not _state:
            vf_unmap(self.shm)
            self.shm = NULL

    def unlink(self):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def attach(SharedState state, int worker):
    """This process is worker ``worker`` of ``state``: endpoints, pools and tenants made
    from now on take their slots there."""
    global _shm, _worker, _state
    if state.shm == NULL or not 0 <= worker < state.shm.workers:
        raise ValueError(f"no worker {worker} in {state.path}")
    _state, _shm, _worker = state, state.shm, worker


def detach():
    """Share nothing from now on (what already holds a slot keeps it)."""
    global _shm, _worker, _state
    _state, _shm, _worker = None, NULL, -1


def attached():
    """(path, worker) of the segment this process shares, or None."""
    return None if _state is None else (_state.path, _worker)


cdef vf_shm *current() noexcept:
    return _shm


cdef int worker() noexcept:
    return _worker


cdef int64_t _slot(char *base, size_t stride, int64_t n, str name, str what) except -1:
    """The index of ``name``'s slot among the ``n`` keys at ``base``, found or claimed."""
    cdef int64_t k
    cdef bytes b = name.encode()
    if len(b) >= VF_NAME:  # a longer name shares its slot by a digest of it
        import hashlib
        b = b[:VF_NAME - 18] + b"#" + hashlib.blake2b(b, digest_size=8).hexdigest().encode()
    k = vf_slot(base, stride, n, b, len(b))
    if k < 0:
        raise OSError(f"shared state: no {what} slot left ({n} in all)")
    return k


cdef EndpointSlot *endpoint_slot(str name) except? NULL:
    if _shm == NULL:
        return NULL
    return vf_eps(_shm) + _slot(<char *>vf_eps(_shm), sizeof(EndpointSlot), VF_EP_SLOTS, name, "endpoint")


cdef PoolSlot *pool_slot(str name) except? NULL:
    if _shm == NULL:
        return NULL
    return vf_pools(_shm) + _slot(<char *>vf_pools(_shm), sizeof(PoolSlot), VF_POOL_SLOTS, name, "pool")


cdef TenantSlot *tenant_slot(str name) except? NULL:
    if _shm == NULL:
        return NULL
    return vf_tenants(_shm) + _slot(<char *>vf_tenants(_shm), sizeof(TenantSlot), VF_TENANT_SLOTS, name, "tenant")


cdef void publish_queue(PoolSlot *p, int band, int64_t n, double oldest) noexcept:
    """This worker's queue depth in ``band`` and when its oldest item there came (0.0:
    none), for the others."""
    if p != NULL and _worker >= 0 and band < VF_MAX_BANDS:
        vf_store(vf_queued_at(p, _worker, band), n)
        vf_pool_publish_oldest(p, _worker, band, oldest)


cdef void publish_limit(EndpointSlot *e, int64_t limit) noexcept:
    if e != NULL and _worker >= 0:
        vf_store(vf_limit_at(e, _worker), limit)


cdef int64_t shared_limit(EndpointSlot *e) noexcept:
    """The smallest concurrency limit a live worker set on ``e`` (0: none yet)."""
    if e == NULL or _shm == NULL:
        return 0
    return vf_ep_limit(e, _shm.workers)


cdef FairCounter fair_counter(object tenant, int band) except *:
    """A tenant's fairness counters in ``band`` (doubles' bits), every worker's; NULLs in
    one process. The anonymous tenant (None) has them too."""
    cdef FairCounter c
    cdef TenantSlot *t = tenant_slot("" if tenant is None else str(tenant))
    c.vtc = c.pend = c.lift = NULL
    if t != NULL:
        c.vtc = vf_tenant_vtc(t, band)
        c.pend = vf_tenant_pend(t, band)
        c.lift = vf_tenant_lift(t, band)
    return c
