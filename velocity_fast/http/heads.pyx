"""The HTTP/1.1 heads this gateway writes, by hand, each in one allocation where it is on
the request path: the client's answers (a whole answer with its body, a stream's head,
the lines a relayed answer carries) and the engine's requests (head and body together,
or side by side for one writev). server/connection.pyx and gateway/exchange.pyx call
them as C; what they write is docs/internals.md's.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

from velocity_fast.lowlevel.fmt cimport cat, dec, digits_before, latin1, put, put_bytes, put_tenths, tenths

from velocity_fast.http.errors import REASONS

cdef dict _STATUS_LINES = {code: f"HTTP/1.1 {code} {reason}\r\n".encode() for code, reason in REASONS.items()}
cdef dict _CT = {
    "application/json": b"content-type: application/json\r\n",
    "text/event-stream": b"content-type: text/event-stream\r\ncache-control: no-cache\r\n",
    "text/plain; version=0.0.4; charset=utf-8": b"content-type: text/plain; version=0.0.4; charset=utf-8\r\n"}
cdef bytes _OK = _STATUS_LINES[200]
# One object with upstream/connection.pyx's and server/connection.pyx's: the proxy's
# usual content type needs no look-up.
cdef str _JSON = intern("application/json")
cdef bytes _JSON_LINE = _CT[_JSON]
cdef bytes _KEEP_END = b"\r\nconnection: keep-alive\r\n\r\n"  # after content-length's value
cdef bytes _CLOSE_END = b"\r\nconnection: close\r\n\r\n"
cdef tuple _FRAMING = (b"connection: close\r\n\r\n",  # (by FRAME_*)
                       b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n",
                       b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")

# 100 Continue, the interim answer to a request that waits for it.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def status_line(int status):
    """b"HTTP/1.1 <status> <reason>\\r\\n"."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} Status\r\n".encode()
    return line


cdef inline bytes _status(int status):
    """The status line (the usual 200 without a look-up)."""
    if status == 200:
        return _OK
    line = _STATUS_LINES.get(status)
    return status_line(status) if line is None else line


cdef inline bytes _ct_line(object content_type):
    """The content-type line; none for None or ""."""
    if content_type is _JSON:  # the proxy's usual answer: no look-up
        return _JSON_LINE
    if not content_type:
        return b""
    ct = _CT.get(content_type)
    return f"content-type: {content_type}\r\n".encode("latin-1") if ct is None else ct


cdef inline bytes _lines(object headers):
    """(name, value) pairs as header lines; bytes are lines already."""
    if type(headers) is bytes:
        return <bytes>headers
    if not headers:
        return b""
    return b"".join([f"{name}: {value}\r\n".encode("latin-1") for name, value in headers])


cdef bytes whole_answer(int status, object content_type, object headers, Py_ssize_t length, bint keep, bytes body):
    """A whole answer's head (status line, content type, ``headers``: (name, value) pairs
    or lines already encoded, Content-Length ``length``, Connection) and ``body``, in one
    allocation: no pieces to join."""
    cdef char digits[24]
    cdef int nd = digits_before(digits + 24, <unsigned long long>length)
    cdef bytes end = _KEEP_END if keep else _CLOSE_END
    cdef Py_ssize_t total
    cdef char* p
    cdef bytes line = _status(status)
    cdef bytes ct = _ct_line(content_type)
    cdef bytes lines = _lines(headers)
    total = (PyBytes_GET_SIZE(line) + PyBytes_GET_SIZE(ct) + PyBytes_GET_SIZE(lines) + 16 + nd
             + PyBytes_GET_SIZE(end) + PyBytes_GET_SIZE(body))
    out = PyBytes_FromStringAndSize(NULL, total)
    p = PyBytes_AS_STRING(out)
    p = put_bytes(p, line)
    p = put_bytes(p, ct)
    p = put_bytes(p, lines)
    memcpy(p, b"content-length: ", 16)
    memcpy(p + 16, digits + 24 - nd, nd)
    p = put_bytes(p + 16 + nd, end)
    put_bytes(p, body)
    return out


cdef bytes stream_head(int status, object content_type, object headers, int framing):
    """A stream's head: status line, content type, ``headers``, then the framing lines
    (FRAME_*) and the blank line."""
    return cat((_status(status), _ct_line(content_type), _lines(headers), _FRAMING[framing]))


cdef bytes _H_RID = b"x-request-id: "
cdef bytes _H_EP = b"\r\nx-velocity-endpoint: "
cdef bytes _H_QMS = b"\r\nx-velocity-queue-ms: "
cdef bytes _H_BAND = b"\r\nx-velocity-band: "


cdef bytes relay_lines(str rid, str endpoint, double queue_ms, str band):
    """The lines a relayed answer carries (x-request-id, x-velocity-endpoint,
    x-velocity-queue-ms in tenths, x-velocity-band), in one step: copied into one bytes
    object when every value is stored a byte per character (the rule), else joined."""
    cdef char num[24]
    cdef int nlen = put_tenths(num, queue_ms)
    cdef bytes out
    cdef char* p
    if nlen < 0 or not (latin1(rid) and latin1(endpoint) and latin1(band)):
        return b"".join((_H_RID, rid.encode("latin-1"), _H_EP, endpoint.encode("latin-1"), _H_QMS,
                         tenths(queue_ms), _H_BAND, band.encode("latin-1"), b"\r\n"))
    out = PyBytes_FromStringAndSize(NULL, len(_H_RID) + len(rid) + len(_H_EP) + len(endpoint) + len(_H_QMS)
                                    + nlen + len(_H_BAND) + len(band) + 2)
    p = PyBytes_AS_STRING(out)
    p = put(put_bytes(p, _H_RID), rid)
    p = put(put_bytes(p, _H_EP), endpoint)
    p = put_bytes(p, _H_QMS)
    memcpy(p, num, nlen)
    p = put(put_bytes(p + nlen, _H_BAND), band)
    p[0] = 13
    p[1] = 10
    return out


# From this size on a body is not copied behind its head: the two leave in one writev.
cdef Py_ssize_t _JOIN_MAX = 2048


cdef object engine_request(bytes head, str rid, bytes auth, bytes body):
    """The engine request: ``head`` (request line, host, content type), x-request-id,
    ``auth``, Content-Length and ``body``, in one allocation; for a body past
    _JOIN_MAX, the head so made and the body itself, as a pair (no copy of the body)."""
    cdef char digits[24]
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef int nd = digits_before(digits + 24, <unsigned long long>n)
    cdef bint apart = n > _JOIN_MAX
    cdef char* p
    if not latin1(rid):
        rid_b = rid.encode("latin-1")  # raises as the header could not be written
        return cat((head, b"x-request-id: ", rid_b, b"\r\n", auth, b"content-length: ", dec(n),
                    b"\r\n\r\n", body))
    out = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(head) + 14 + len(rid) + 2 + PyBytes_GET_SIZE(auth)
                                    + 16 + nd + 4 + (0 if apart else n))
    p = put_bytes(PyBytes_AS_STRING(out), head)
    memcpy(p, b"x-request-id: ", 14)
    p = put(p + 14, rid)
    memcpy(p, b"\r\n", 2)
    p = put_bytes(p + 2, auth)
    memcpy(p, b"content-length: ", 16)
    memcpy(p + 16, digits + 24 - nd, nd)
    p += 16 + nd
    memcpy(p, b"\r\n\r\n", 4)
    if apart:
        return (out, body)
    put_bytes(p + 4, body)
    return out
