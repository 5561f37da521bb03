# The engine connection as a typed class (see connection.pyx).

from velocity_fast.http.http1 cimport Head
from velocity_fast.io.outbox cimport OutboxOwner, Outbox


cdef class ResponseHandler


cdef class UpstreamConnection(OutboxOwner):
    cdef received(self, bytes data)
    cdef public object pool
    cdef public object transport
    cdef Outbox _outbox
    cdef object _parser
    cdef object _loop
    cdef public int status
    cdef dict _headers
    cdef bytes _hdata
    cdef Py_ssize_t _hlines
    cdef Py_ssize_t _hend
    cdef public object content_type
    cdef public bint has_length
    cdef public bint te_chunked
    cdef object _head
    cdef public list chunks
    cdef public bint done
    cdef public object error
    cdef object _waiter
    cdef bint _received
    cdef public bint keep_alive
    cdef public bint closed
    cdef readonly bint _paused
    cdef public long requests
    cdef public ResponseHandler handler
    cdef object _resend
    cdef bint _parsing
    cdef readonly bint _chunked
    cdef bint _raw
    cdef int _cstate
    cdef long long _csize
    cdef int _cdigits
    cdef Py_ssize_t _cleft

    cdef _reset(self)
    cdef _scanned_head(self, bytes data, Head* head)
    cdef _whole_response(self, bytes data, Head* head)
    cdef _complete(self)
    cdef _chunked_head(self, bytes data, Head* head)
    cdef _deliver(self, bytes piece)
    cdef _scan_chunks(self, bytes data, Py_ssize_t pos)
    cdef _flush_run(self, bytes data, Py_ssize_t run_s, Py_ssize_t run_e)
    cdef _bad_chunk(self)
    cpdef _fail(self, err)
    cdef _wake(self)
    cpdef send_to(self, data, ResponseHandler handler, bint reused=*)
    cpdef bytes take(self)
    cpdef pause(self)
    cpdef resume(self)
    cpdef abort(self)


# What a callback-driven request is told (connection.pyx): every handler subclasses it.
cdef class ResponseHandler:
    cdef public bint relaying
    cdef public bint raw_chunks
    cdef public bint abandoned

    cpdef on_sent(self, UpstreamConnection conn)
    cpdef on_head(self, UpstreamConnection conn)
    cpdef on_body(self, UpstreamConnection conn, bytes data)
    cpdef on_raw(self, UpstreamConnection conn, bytes framed)
    cpdef on_done(self, UpstreamConnection conn)
    cpdef on_error(self, UpstreamConnection conn, err)
