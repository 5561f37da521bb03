# The gateway's own socket I/O (see fdio.pyx).

from libc.stdint cimport uint32_t


cdef class Protocol:
    cdef received(self, bytes data)
    cdef received_buf(self, const char* buf, Py_ssize_t n)
    cdef char* recv_target(self, Py_ssize_t* room) noexcept
    cdef int received_into(self, Py_ssize_t n) except -1


cdef class Poller:
    cdef object __weakref__
    cdef int _epfd
    cdef object _loop
    cdef set _live
    cdef char* _buf
    cdef void* _events


cdef class FdTransport:
    cdef int _fd
    cdef Poller _poller
    cdef object _loop
    cdef object _sock
    cdef object _protocol
    cdef Protocol _fast
    cdef object _peername
    cdef uint32_t _mask
    cdef bint closing
    cdef bint _reading
    cdef bint _eof_pending
    cdef bint _eof_sent
    cdef bint _protocol_paused
    cdef bint _lost
    cdef list _wbuf
    cdef Py_ssize_t _woff
    cdef Py_ssize_t wsize
    cdef Py_ssize_t _high
    cdef Py_ssize_t _low

    cdef int write_bytes(self, bytes data) except -1
    cdef int write_list(self, list pieces) except -1
    cdef int _update(self) except -1
    cdef int _readable(self) except -1
    cdef int _writable(self) except -1
    cdef int _sent(self) except -1
    cdef _fatal(self, exc, str message)
    cdef _force_close(self, exc)
    cdef _maybe_pause(self)
    cdef _flow(self, bint pause)
