# The parsed HTTP request as a typed class (see message.pyx).

# The headers the gateway reads on its proxy path, by index: the scanner keeps where
# each one's value lies (Request.own), so that the path reads them with no dict.
cdef enum:
    OWN_RID = 0        # x-request-id
    OWN_TENANT = 1     # x-velocity-tenant
    OWN_PRIORITY = 2   # x-velocity-priority
    OWN_SLA = 3        # x-velocity-sla-ms
    OWN_PROFILE = 4    # x-velocity-profile
    OWN_SESSION = 5    # x-session-id
    OWN_AUTH = 6       # authorization (the client's key, when keys are required)
    OWN_APIKEY = 7     # x-api-key (the same)
    OWN_N = 8
    OWN_DUP = 256      # one of them named twice: the dict joins the values (own_direct() is False)

cdef class Request:
    cdef public str method
    cdef public str path
    cdef public str query
    cdef dict _headers
    cdef bytes head_data     # the scanner's: the bytes the header lines lie in, until asked
    cdef Py_ssize_t lines_start  # the header lines lie at [lines_start, lines_end) of head_data
    cdef Py_ssize_t lines_end
    cdef public str http_version
    cdef public bint keep_alive
    cdef public object client
    cdef public double received_at
    cdef public bytes body
    cdef public bint expect_continue
    cdef public bint gateway_headers
    cdef unsigned int own    # bit OWN_*: that header seen once, its value at [own_vs, own_ve) of head_data
    cdef Py_ssize_t own_vs[8]
    cdef Py_ssize_t own_ve[8]

    cdef dict header_dict(self)
    cdef dict own_headers(self)
    cdef bint own_direct(self)
    cdef object own_text(self, int which)


cdef Request new_request(str method, str path, str query, dict headers, str http_version, bint keep_alive,
                         client, double received_at, bytes body)


cdef object header_name(const char* p, Py_ssize_t n)
cdef object short_text(const char* p, Py_ssize_t n)
cdef dict header_lines(bytes raw, Py_ssize_t pos, Py_ssize_t end, bint join, bint only_x=*)
