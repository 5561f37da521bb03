# The parsed HTTP request as a typed class (see message.pyx).

cdef class Request:
    cdef public str method
    cdef public str path
    cdef public str query
    cdef dict _headers
    cdef bytes _raw          # the scanner's: the bytes the header lines lie in, until asked
    cdef Py_ssize_t _hs
    cdef Py_ssize_t _he
    cdef public str http_version
    cdef public bint keep_alive
    cdef public object client
    cdef public double received_at
    cdef public bytes body
    cdef public bint expect_continue
    cdef public bint gateway_headers

    cdef dict header_dict(self)
    cdef dict own_headers(self)


cdef Request new_request(str method, str path, str query, dict headers, str http_version, bint keep_alive,
                         client, double received_at, bytes body)


cdef object header_name(const char* p, Py_ssize_t n)
cdef object short_text(const char* p, Py_ssize_t n)
cdef dict header_lines(bytes raw, Py_ssize_t pos, Py_ssize_t end, bint join, bint only_x=*)
