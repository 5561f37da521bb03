# The one-call HTTP/1.1 scanners (see http1.pyx), as C for the server.

from velocity_fast._core.message cimport Request

cdef Request take_request(bytes data, Py_ssize_t pos, Py_ssize_t max_head, Py_ssize_t max_body, client,
                          double received_at, Py_ssize_t* end)
