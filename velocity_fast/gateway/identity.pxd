# Who is calling, typed (see identity.pyx).

from cpython.object cimport PyObject

from velocity_fast.state.bucket cimport Bucket

cdef class Tenant:
    cdef public str name
    cdef public object max_band
    cdef readonly object rate       # requests per second (None: no limit)
    cdef readonly double burst
    cdef public object weight
    cdef public object sla_ms
    cdef readonly object tpm        # tokens per minute (None: no quota)
    # Its buckets, in this process, the workers' shared memory or the state store as the
    # config says (state/bucket.pyx; None: no limit): requests, and engine tokens
    cdef readonly Bucket request_bucket
    cdef readonly Bucket token_bucket
    # What the engines served this tenant, and its requests declined, by reason
    cdef public long long served_prompt
    cdef public long long served_cached
    cdef public long long served_completion
    cdef public dict rejections

    cpdef double take(self) except -1
    cpdef double take_tokens(self, double estimate) except -1
    cpdef settle_tokens(self, double delta)


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
    cpdef tuple authenticate_key(self, key)
    cpdef tuple tenant_for(self, bound, header, user)
    cdef object tenant_name(self, bound, header, user)
    cdef object tenant_named(self, bound, name)
    cdef Tenant by_header(self, const char* p, Py_ssize_t n)
    cdef void keep_header(self, const char* p, Py_ssize_t n, Tenant t) except *


# The request path's draw and settlement of a tenant's tokens per minute (ingress.pyx,
# exchange.pyx): one C call on its bucket, at the clock the caller already read (0.0:
# none; the bucket reads it if its home needs it).

cdef inline double tenant_draw_tokens(Tenant t, double estimate, double now) except -1:
    """Tenant.take_tokens(estimate) at ``now`` (the monotonic clock the caller read, or 0.0)."""
    cdef Bucket b = t.token_bucket
    if b is None:
        return 0.0
    return b.draw_at(estimate, estimate if estimate < b.cap else b.cap, now)


cdef inline int tenant_settle_tokens(Tenant t, double delta) except -1:
    """Tenant.settle_tokens(delta)."""
    if t.token_bucket is not None:
        t.token_bucket.settle_at(delta, 0.0)
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
