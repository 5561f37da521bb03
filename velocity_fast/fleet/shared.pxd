# The state worker processes share (see shared.pyx and csrc/shared_state.h).

from libc.stdint cimport int64_t

cdef extern from "shared_state.h":
    int VF_MAX_WORKERS
    int VF_MAX_BANDS
    ctypedef struct vf_ep:
        int64_t inflight
        int64_t overcommits
    ctypedef struct vf_pool:
        int64_t committed
    ctypedef struct vf_cell:
        double rate
        double cap
    ctypedef struct vf_tenant:
        vf_cell req
        vf_cell tok
    ctypedef struct vf_shm:
        int64_t workers

    int64_t vf_atomic_add "VF_ADD"(int64_t *p, int64_t v) nogil
    int64_t vf_ep_add(vf_ep *e, int w, int64_t d) nogil
    int64_t vf_ep_claim(vf_ep *e, int w, int64_t limit) nogil
    int64_t vf_ep_limit(vf_ep *e, int64_t workers) nogil
    double vf_ep_cap(vf_ep *e) nogil
    void vf_ep_learn_cap(vf_ep *e, double cap) nogil
    int vf_pool_reserve(vf_pool *p, int w, int64_t capacity) nogil
    void vf_pool_release(vf_pool *p, int w) nogil
    int64_t vf_pool_queued_others(vf_pool *p, int w, int64_t workers, int band) nogil
    int vf_pool_older_elsewhere(vf_pool *p, int w, int64_t workers, int band, double at) nogil
    void vf_pool_publish_oldest(vf_pool *p, int w, int band, double at) nogil
    void vf_cell_config(vf_cell *c, double rate, double cap) nogil
    double vf_cell_draw(vf_cell *c, double amount, double need) nogil
    void vf_cell_settle(vf_cell *c, double delta) nogil
    double vf_cell_left(vf_cell *c) nogil
    double vf_dbl_load(int64_t *p) nogil
    double vf_dbl_add(int64_t *p, double d) nogil
    double vf_dbl_raise(int64_t *p, double v) nogil
    int64_t *vf_tenant_vtc(vf_tenant *t, int band) nogil
    int64_t *vf_tenant_pend(vf_tenant *t, int band) nogil
    int64_t *vf_tenant_lift(vf_tenant *t, int band) nogil


cdef class SharedState:
    cdef vf_shm *shm
    cdef readonly str path
    cdef readonly bint owner


# This process's segment and worker index (NULL and -1: one process, nothing shared).
cdef vf_shm *current() noexcept
cdef int worker() noexcept
cdef vf_ep *endpoint_slot(str name) except? NULL
cdef vf_pool *pool_slot(str name) except? NULL
cdef vf_tenant *tenant_slot(str name) except? NULL
cdef int64_t *tenant_counter(object tenant, int band) except? NULL
cdef void publish_queued(vf_pool *p, int band, int64_t n) noexcept
cdef void publish_limit(vf_ep *e, int64_t limit) noexcept
cdef int64_t shared_limit(vf_ep *e) noexcept
