# The engine connection pool, typed (see pool.pyx).

from velocity_fast.upstream.connection cimport ResponseHandler, UpstreamConnection


cdef class UpstreamPool:
    cdef public str url
    cdef public str host
    cdef public int port
    cdef public double connect_timeout
    cdef public set _all
    cdef public set _connecting
    cdef public long connects
    # The idle connections are _idle[:_n_idle], most recent last; the slots past it hold
    # None. The list keeps its length: a list that shrank and grew by one with each
    # request reallocated its array at every crossing of half its capacity.
    cdef public list _idle
    cdef public Py_ssize_t _n_idle
    cdef public dict _json_posts
    cdef public Py_ssize_t max_idle
    cdef public str base_path
    cdef public bytes host_header
    cdef str _last_path
    cdef bytes _last_head

    cpdef bytes json_post_head(self, str path)
    cpdef UpstreamConnection idle_connection(self)
    cdef void _keep_idle(self, UpstreamConnection conn)
    cpdef release(self, UpstreamConnection conn)
    cpdef request(self, data, ResponseHandler handler)
