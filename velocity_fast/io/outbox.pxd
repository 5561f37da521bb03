# The outbox, typed (see outbox.pyx).

from velocity_fast.io.fdio cimport FdTransport, Protocol


cdef class OutboxOwner(Protocol):
    cdef public object _out  # None, one bytes piece, or a list of them
    cdef public Py_ssize_t _out_bytes
    cdef public object _transport
    cdef object _t_write
    cdef object _t_is_closing
    cdef object _t_for


cdef class Outbox:
    cdef object __weakref__
    cdef object _loop
    cdef list _owners
    cdef bint _scheduled

    cpdef write(self, OutboxOwner owner, bytes data)


cpdef flush_out(OutboxOwner owner)
cpdef Outbox outbox_for(loop)


cdef inline Py_ssize_t transport_buffered(t) except -1:
    """What waits in transport ``t``'s own buffer."""
    if type(t) is FdTransport:
        return (<FdTransport>t).wsize
    return t.get_write_buffer_size()
