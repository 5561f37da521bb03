# Who is calling, typed (see identity.pyx).

cdef class Tenant:
    cdef public str name
    cdef public object max_band
    cdef public object rate
    cdef public double burst
    cdef public double tokens
    cdef public double stamp
    cdef public object weight
    cdef public object sla_ms

    cpdef double take(self) except -1


cdef class Identity:
    cdef public object global_key
    cdef public dict tenants
    cdef public dict by_key
    cdef public bint required

    cpdef tuple authenticate(self, dict headers)
    cpdef tuple tenant_for(self, bound, header, user)
    cdef object tenant_name(self, bound, header, user)
    cdef object tenant_named(self, bound, name)
