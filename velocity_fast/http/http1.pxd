# The one-call HTTP/1.1 scanners (see http1.pyx), as C for the server.

from velocity_fast.http.message cimport Request

cdef Request take_request(bytes data, Py_ssize_t pos, Py_ssize_t max_head, Py_ssize_t max_body, client,
                          double received_at, Py_ssize_t* end, Py_ssize_t* have=*)
cdef Request take_request_at(const char* s, Py_ssize_t n, Py_ssize_t max_head, Py_ssize_t max_body, client,
                             double received_at, Py_ssize_t* end, Py_ssize_t* have)


# What the header scan found: the framing, Connection, where Content-Type's value lies
# (responses), and where the header lines start and end.
cdef struct Head:
    int status
    int keep_alive           # 1 keep-alive, 0 close, -2 not said
    bint chunked
    Py_ssize_t content_length  # -1: none
    Py_ssize_t lines
    Py_ssize_t end
    Py_ssize_t ct_start      # -1: none
    Py_ssize_t ct_len
    bint ours                # a request header the gateway reads (x-velocity-*...)
    unsigned int own         # Request.own: which of those the proxy path reads were seen (OWN_*)
    Py_ssize_t own_vs[8]     # where their values lie (only those seen)
    Py_ssize_t own_ve[8]

cdef int take_response(bytes data, Py_ssize_t pos, Head* out) except -2
