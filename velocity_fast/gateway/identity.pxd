# Who is calling, typed (see identity.pyx).

from cpython.object cimport PyObject

from velocity_fast.fleet.shared cimport vf_tenant

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

    cpdef tuple authenticate(self, dict headers)
    cpdef tuple tenant_for(self, bound, header, user)
    cdef object tenant_name(self, bound, header, user)
    cdef object tenant_named(self, bound, name)
    cdef Tenant by_header(self, const char* p, Py_ssize_t n)
    cdef void keep_header(self, const char* p, Py_ssize_t n, Tenant t) except *
