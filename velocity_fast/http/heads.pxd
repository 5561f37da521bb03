# The HTTP/1.1 heads this gateway writes, typed (see heads.pyx).

# How a started stream's body is framed (stream_head).
cdef enum:
    FRAME_CLOSE = 0        # HTTP/1.0: until the connection closes
    FRAME_CHUNKED_KEEP = 1  # chunked, the connection kept
    FRAME_CHUNKED_CLOSE = 2  # chunked, the connection closed after it

cdef bytes whole_answer(int status, object content_type, object headers, Py_ssize_t length, bint keep, bytes body)
cdef bytes stream_head(int status, object content_type, object headers, int framing)
cdef bytes relay_lines(str rid, str endpoint, double queue_ms, str band)
cdef object engine_request(bytes head, str rid, bytes auth, bytes body)


cdef inline list rid_header(str rid):
    """x-request-id, the header every answer carries, as the (name, value) pair an error's
    answer is given (a relayed answer's lines are written whole: relay_lines)."""
    return [("x-request-id", rid)]
