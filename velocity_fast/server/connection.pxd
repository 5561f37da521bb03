# The server's typed connection and response objects (see connection.pyx).

from velocity_fast.io.outbox cimport Outbox, OutboxOwner
from velocity_fast.http.message cimport Request

cdef class Responder:
    cdef readonly HttpProtocol proto
    cdef readonly Request _request
    cdef public bint started
    cdef public bint finished
    cdef public bint disconnected
    cdef readonly int _mode
    cdef bint _keep
    cdef object _watcher
    cdef list _callbacks
    cdef public object _task
    cdef public int status
    cdef readonly bint cut_short  # the server's shutdown grace ended it (Responder.cut)
    cdef bint _sse  # a started text/event-stream response

    cpdef send(self, int status, bytes body=*, content_type=*, headers=*)
    cpdef add_disconnect_callback(self, cb)
    cpdef remove_disconnect_callback(self, cb)
    cpdef bint write_nowait(self, bytes data) except -1
    cpdef bint write_chunks(self, bytes framed) except -1
    cpdef _lost(self)


cdef class HttpProtocol(OutboxOwner):
    cdef received(self, bytes data)
    cdef received_buf(self, const char* buf, Py_ssize_t n)
    cdef bint _wait_body(self, Request req, Py_ssize_t have) except -1
    cdef object _server
    cdef readonly object _loop
    cdef object _handler
    cdef Outbox _outbox
    cdef object _parser
    cdef object _client
    cdef Py_ssize_t _max_header_bytes
    cdef Py_ssize_t _max_body_bytes
    cdef double _header_timeout
    cdef double _body_timeout
    cdef double _keepalive_timeout
    cdef double _first_byte_timeout
    cdef object _on_error
    cdef double _linger_timeout
    cdef Py_ssize_t _max_pipelined
    cdef Py_ssize_t _write_buffer_high
    cdef bytes _url
    cdef list _headers
    cdef Py_ssize_t _head_bytes
    cdef Py_ssize_t _head_raw
    cdef bint _in_head
    cdef list _body
    cdef Py_ssize_t _body_len
    cdef Request _req
    cdef Request _pend  # a request taken whole but for the rest of its body
    cdef Py_ssize_t _pend_have
    cdef Py_ssize_t _fill(self, bytes data) except -1
    cdef char* recv_target(self, Py_ssize_t* room) noexcept
    cdef int received_into(self, Py_ssize_t n) except -1
    cdef readonly bint _in_message
    cdef readonly list _queue
    cdef public Responder _active
    cdef object _fatal
    cdef bint _ignore_input
    cdef bint _continue_pending
    cdef readonly bint write_paused
    cdef object _drain_waiter
    cdef readonly bint _read_paused
    cdef readonly bint _closing
    cdef readonly bint _closed
    cdef object _timer
    cdef double _timer_at
    cdef double _deadline
    cdef int _on_deadline
    cdef double _timer_step

    cdef _write(self, bytes data)
    cpdef _close(self)
    cdef _arm(self, double delay, int what)
    cdef _schedule(self, double deadline)
    cdef _on_read_timeout(self)
    cdef _take(self, Request req)
    cdef bint _keep_alive_after(self, Request req) except -1
    cdef _next(self)
    cdef _answer(self, Request req)
    cdef _handler_failed(self, Request req, Responder resp, str what=*)
    cdef _response_done(self, Responder resp, bint keep_alive)
    cdef _fail(self, int status, str message)
    cdef _send_fatal(self)
    cdef _close_after_answer(self)
    cdef _linger(self)
