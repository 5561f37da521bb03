# Who is calling, typed (see identity.pyx).

from cpython.object cimport PyObject

from velocity_fast.fleet.shared cimport vf_tenant
from velocity_fast.lowlevel.clock cimport monotonic

cdef class Tenant:
    cdef public str name
    cdef public object max_band
    cdef readonly object rate       # requests per second (None: no limit)
    cdef public double burst
    cdef public double tokens
    cdef public double stamp
    cdef public object weight
    cdef public object sla_ms
    # Tokens per minute: a bucket of tokens (None: no quota), its level (below 0: in debt)
    cdef readonly object tpm
    cdef public double tlevel
    cdef double rate_c              # rate and tpm as C doubles (0.0 where None), set with them
    cdef double tpm_c
    cdef public double tstamp
    # What the engines served this tenant, and its requests declined, by reason
    cdef public long long served_prompt
    cdef public long long served_cached
    cdef public long long served_completion
    cdef public dict rejections
    # Leases of the buckets shared across replicas (fleet/statestore.py; None: local only)
    cdef public object shared
    cdef public object tshared
    # Workers: the tenant's slot in the shared state (NULL: one process)
    cdef vf_tenant *shm

    cpdef double take(self) except -1
    cpdef double take_tokens(self, double estimate) except -1
    cpdef settle_tokens(self, double delta)
    cdef void _refill(self) noexcept


# A tenant named by the x-velocity-tenant header, kept by the header's bytes (up to 32).
cdef struct HeaderSlot:
    Py_ssize_t n              # 0: empty
    char raw[32]
    PyObject* tenant          # a reference the Identity holds


cdef class Identity:
    cdef public object global_key
    cdef public dict tenants
    cdef public dict by_key
    cdef public bint required
    # The last name tenant_named found a tenant for, and that tenant: the header's text is
    # one shared str while it repeats (http/message.pyx), so the next request of the same
    # tenant needs no dict look-up. (``tenants`` is not changed once requests are served:
    # a reload makes a new Identity.)
    cdef object _last_name
    cdef object _last_tenant
    # Tenants by their header's bytes (HEADER_SLOTS of them, made when the first is kept):
    # the request path then makes no str of the header and looks up no dict.
    cdef HeaderSlot* _slots
    # The last header by_header found, and its tenant (a header's bytes name the same
    # tenant for the Identity's life): a repeated header is found without hashing it.
    cdef HeaderSlot _last_header

    cpdef tuple authenticate(self, dict headers)
    cpdef tuple tenant_for(self, bound, header, user)
    cdef object tenant_name(self, bound, header, user)
    cdef object tenant_named(self, bound, name)
    cdef Tenant by_header(self, const char* p, Py_ssize_t n)
    cdef void keep_header(self, const char* p, Py_ssize_t n, Tenant t) except *


# The request path's draw and settlement of a tenant's tokens per minute (ingress.pyx, exchange.pyx),
# inline where its bucket is this process's own: no method call, and the draw refills to
# the clock its caller already read. A shared bucket (state store, workers) is left to
# Tenant.take_tokens and settle_tokens.

cdef inline void _tokens_refill(Tenant t, double now) noexcept:
    """Tenant._refill at ``now`` (a time before the bucket's last: no refill, as none is due)."""
    cdef double cap = t.tpm_c, level = t.tlevel
    if now > t.tstamp:
        level = level + (now - t.tstamp) * cap / 60.0
        t.tstamp = now
    t.tlevel = level if level < cap else cap


cdef inline double tenant_draw_tokens(Tenant t, double estimate, double now) except -1:
    """Tenant.take_tokens(estimate) at ``now`` (the monotonic clock, read by the caller)."""
    cdef double need, cap = t.tpm_c
    if t.tshared is not None or t.shm != NULL or t.tpm is None:
        return t.take_tokens(estimate)
    need = estimate if estimate < cap else cap
    _tokens_refill(t, now)
    if t.tlevel >= need:
        t.tlevel -= estimate
        return 0.0
    return (need - t.tlevel) * 60.0 / cap


cdef inline int tenant_settle_tokens(Tenant t, double delta) except -1:
    """Tenant.settle_tokens(delta)."""
    if t.tshared is not None or t.shm != NULL:
        t.settle_tokens(delta)
    elif t.tpm is not None:
        _tokens_refill(t, monotonic())
        t.tlevel -= delta
    return 0


cdef inline Tenant tenant_by_header(Identity idn, const char* p, Py_ssize_t n):
    """Identity.by_header(p, n), the header by_header found last compared first."""
    cdef Py_ssize_t i
    if n == idn._last_header.n and n > 0:
        for i in range(n):  # (a short name: no memcmp call)
            if idn._last_header.raw[i] != p[i]:
                return idn.by_header(p, n)
        return <Tenant>idn._last_header.tenant
    return idn.by_header(p, n)
