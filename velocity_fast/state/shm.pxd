# The state worker processes share in memory, typed (see shm.pyx and csrc/shared_state.h).
#
# The slots and the raw vf_* operations are declared here for state/ alone; every other
# module holds a slot pointer (EndpointSlot, PoolSlot, FairCounter) and calls the inline
# functions below, which keep this process's own count where nothing is shared (a NULL
# slot): the one place that says whether a count lives here or in every worker.

from libc.stdint cimport int64_t

cdef extern from "shared_state.h":
    int VF_MAX_WORKERS
    int VF_MAX_BANDS
    ctypedef struct EndpointSlot "vf_ep":
        int64_t inflight
        int64_t overcommits
    ctypedef struct PoolSlot "vf_pool":
        int64_t committed
        int64_t refused
    ctypedef struct vf_cell:
        double rate
        double cap
    ctypedef struct TenantSlot "vf_tenant":
        vf_cell req
        vf_cell tok
    ctypedef struct vf_shm:
        int64_t workers

    int64_t vf_load "VF_LOAD"(int64_t *p) nogil
    int64_t vf_atomic_add "VF_ADD"(int64_t *p, int64_t v) nogil
    int64_t vf_ep_add(EndpointSlot *e, int w, int64_t d) nogil
    int64_t vf_ep_claim(EndpointSlot *e, int w, int64_t limit) nogil
    int64_t vf_ep_limit(EndpointSlot *e, int64_t workers) nogil
    double vf_ep_cap(EndpointSlot *e) nogil
    void vf_ep_learn_cap(EndpointSlot *e, double cap) nogil
    int vf_pool_reserve(PoolSlot *p, int w, int64_t capacity) nogil
    void vf_pool_release(PoolSlot *p, int w) nogil
    int64_t vf_pool_queued_others(PoolSlot *p, int w, int64_t workers, int band) nogil
    int vf_pool_older_elsewhere(PoolSlot *p, int w, int64_t workers, int band, double at) nogil
    void vf_pool_publish_oldest(PoolSlot *p, int w, int band, double at) nogil
    void vf_cell_config(vf_cell *c, double rate, double cap) nogil
    double vf_cell_draw(vf_cell *c, double amount, double need) nogil
    void vf_cell_settle(vf_cell *c, double delta) nogil
    double vf_cell_left(vf_cell *c) nogil
    double vf_dbl_load(int64_t *p) nogil
    double vf_dbl_add(int64_t *p, double d) nogil
    double vf_dbl_raise(int64_t *p, double v) nogil
    int64_t *vf_tenant_vtc(TenantSlot *t, int band) nogil
    int64_t *vf_tenant_pend(TenantSlot *t, int band) nogil
    int64_t *vf_tenant_lift(TenantSlot *t, int band) nogil


cdef class SharedState:
    cdef vf_shm *shm
    cdef readonly str path
    cdef readonly bint owner


# This process's segment and worker index (NULL and -1: one process, nothing shared).
cdef vf_shm *current() noexcept
cdef int worker() noexcept
cdef EndpointSlot *endpoint_slot(str name) except? NULL
cdef PoolSlot *pool_slot(str name) except? NULL
cdef TenantSlot *tenant_slot(str name) except? NULL
cdef void publish_limit(EndpointSlot *e, int64_t limit) noexcept
cdef int64_t shared_limit(EndpointSlot *e) noexcept
cdef void publish_queue(PoolSlot *p, int band, int64_t n, double oldest) noexcept


# -- an endpoint's requests in flight --------------------------------------------------
# ``own``: this process's count, kept by the caller (Endpoint.inflight); the answer is the
# count to keep: every worker's total where the endpoint has a slot, else own + d.

cdef inline long inflight_add(EndpointSlot *e, long own, long d) noexcept:
    if e == NULL:
        return own + d
    return <long>vf_ep_add(e, worker(), d)


cdef inline long inflight_claim(EndpointSlot *e, long limit) noexcept:
    """One more of this worker's requests on ``e`` if every worker's stay within ``limit``:
    the new total, else -1 (full)."""
    return <long>vf_ep_claim(e, worker(), limit)


cdef inline long inflight_total(EndpointSlot *e, long own) noexcept:
    """Every worker's requests on ``e`` (``own`` where nothing is shared)."""
    if e == NULL:
        return own
    return <long>vf_load(&e.inflight)


cdef inline void overcommitted(EndpointSlot *e) noexcept:
    """A bind past the limit: counted where the workers can see it."""
    if e != NULL:
        vf_atomic_add(&e.overcommits, 1)


cdef inline double batch_learned(EndpointSlot *e) noexcept:
    """The largest batch a worker learned on ``e`` (0: none yet, or nothing shared)."""
    if e == NULL:
        return 0.0
    return vf_ep_cap(e)


cdef inline void learn_batch(EndpointSlot *e, double cap) noexcept:
    if e != NULL:
        vf_ep_learn_cap(e, cap)


# -- a pool's reservations and queue depths ---------------------------------------------
# A reservation is one grant, bound or not, of any worker: a grant made within the pool's
# limits finds an engine with room at its bind. The callers hold a non-NULL slot.

cdef inline bint reserve(PoolSlot *p, long capacity) noexcept:
    return vf_pool_reserve(p, worker(), capacity) != 0


cdef inline void unreserve(PoolSlot *p) noexcept:
    vf_pool_release(p, worker())


cdef inline bint queued_elsewhere(PoolSlot *p, int band) noexcept:
    """Another worker holds requests queued in ``band`` or a higher one."""
    return band >= 0 and vf_pool_queued_others(p, worker(), current().workers, band) > 0


cdef inline bint older_elsewhere(PoolSlot *p, int band, double at) noexcept:
    """Another worker holds an item of ``band`` that came before ``at``."""
    return vf_pool_older_elsewhere(p, worker(), current().workers, band, at) != 0


# -- a tenant's fairness counters, per band ---------------------------------------------
# The counter, what of it answers in flight hold, and what lifts added; each NULL where
# nothing is shared. ``own`` is this process's copy, kept up to date by each call.

cdef struct FairCounter:
    int64_t *vtc
    int64_t *pend
    int64_t *lift


cdef FairCounter fair_counter(object tenant, int band) except *


cdef inline double fair_add(int64_t *shared, double *own, double d) noexcept:
    if shared != NULL:
        own[0] = vf_dbl_add(shared, d)
    else:
        own[0] += d
    return own[0]


cdef inline double fair_load(int64_t *shared, double *own) noexcept:
    if shared != NULL:
        own[0] = vf_dbl_load(shared)
    return own[0]


cdef inline double fair_raise(int64_t *shared, double *own, double v) noexcept:
    """Raise the counter to at least ``v`` (raised, not added: another worker may have
    raised it meanwhile): the value it holds then."""
    if shared != NULL:
        own[0] = vf_dbl_raise(shared, v)
    elif own[0] < v:
        own[0] = v
    return own[0]
