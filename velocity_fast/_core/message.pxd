# The parsed HTTP request as a typed class (see message.pyx).

cdef class Request:
    cdef public str method
    cdef public str path
    cdef public str query
    cdef public dict headers
    cdef public str http_version
    cdef public bint keep_alive
    cdef public object client
    cdef public double received_at
    cdef public bytes body
    cdef public bint expect_continue
    cdef public bint gateway_headers


cdef Request new_request(str method, str path, str query, dict headers, str http_version, bint keep_alive,
                         client, double received_at, bytes body)
