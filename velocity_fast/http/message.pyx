"""One parsed HTTP request, compiled: the server makes one per request and the gateway's
request path reads its fields as C struct fields (a msgspec Struct's are attribute
look-ups from compiled code: a type look-up and a descriptor call each).

Python sees the same attributes as before (message.pyi documents them); the
server and the scanner (http1.pyx) make it with new_request, without an __init__ call.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_DecodeLatin1
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp, memcpy


cdef extern from "Python.h":
    PyObject* PyDict_SetDefault(object d, object key, object default) except NULL  # borrowed
    Py_ssize_t PyDict_GET_SIZE(object d)


# Header names decoded once: a small table by a hash of the lower-case bytes, each slot
# keeping the first name (up to 32 bytes) that lands there. No bytes object, no dict.
cdef struct _NameSlot:
    Py_ssize_t n
    char name[32]
    PyObject* text
cdef _NameSlot _SLOTS[256]


cdef object header_name(const char* p, Py_ssize_t n):
    """The header name as a lower-case str (names seen before shared)."""
    cdef char buf[64]
    cdef Py_ssize_t i
    cdef unsigned int h = 2166136261u
    cdef unsigned char c
    cdef _NameSlot* slot
    if n > 64:
        return PyBytes_FromStringAndSize(p, n).decode("latin-1").lower()
    for i in range(n):
        c = <unsigned char>p[i]
        if c >= 65 and c <= 90:
            c += 32
        buf[i] = <char>c
        h = (h ^ c) * 16777619u  # FNV-1a
    slot = &_SLOTS[(h ^ (h >> 8) ^ (h >> 16)) & 255]
    if slot.n == n and memcmp(slot.name, buf, n) == 0:
        return <object>slot.text
    name = PyUnicode_DecodeLatin1(buf, n, NULL)
    if slot.n == 0 and n <= 32:
        memcpy(slot.name, buf, n)
        slot.text = <PyObject*>name
        Py_INCREF(name)  # the table keeps it for the process's life
        slot.n = n
    return name


# Short texts of a request decoded once while they repeat: the method, the path, header
# values (the host, the content type...). A slot keeps the last text that landed there,
# so a text that does not repeat costs a decode, as without the table, and the ones
# that do are shared (with their hash, once a dict has asked for it).
cdef _NameSlot _TEXTS[512]


cdef inline unsigned int _text_hash(const char* p, Py_ssize_t n) noexcept nogil:
    """A hash of ``p[:n]`` (n <= 32) from three 8-byte words, the first, the middle and
    the last, instead of a step per byte: two texts that differ only between them share
    a slot, which stays correct (the slot's bytes are compared) if slower for them."""
    cdef uint64_t a = 0, b = 0, c = 0, h
    if n >= 8:
        memcpy(&a, p, 8)
        memcpy(&b, p + (n >> 1) - 4, 8)
        memcpy(&c, p + n - 8, 8)
    else:
        memcpy(&a, p, n)
    h = (a * 0x9E3779B97F4A7C15ULL) ^ (b * 0xC2B2AE3D27D4EB4FULL) ^ (c * 0x165667B19E3779F9ULL) ^ <uint64_t>n
    h ^= h >> 29
    return <unsigned int>(h ^ (h >> 32))


cdef object short_text(const char* p, Py_ssize_t n):
    """p[:n] decoded as Latin-1, shared with the last equal text seen (up to 32 bytes)."""
    cdef _NameSlot* slot
    if n > 32:
        return PyUnicode_DecodeLatin1(p, n, NULL)
    slot = &_TEXTS[_text_hash(p, n) & 511]
    if slot.text != NULL and slot.n == n and memcmp(slot.name, p, n) == 0:
        return <object>slot.text
    text = PyUnicode_DecodeLatin1(p, n, NULL)
    Py_XDECREF(slot.text)
    memcpy(slot.name, p, n)
    slot.text = <PyObject*>text
    Py_INCREF(text)  # the table's reference, until another text takes the slot
    slot.n = n
    return text


cdef dict header_lines(bytes raw, Py_ssize_t pos, Py_ssize_t end, bint join, bint only_x=False):
    """The header lines of ``raw[pos:end]`` (lines a scanner checked: name, ':', spaces,
    value, CRLF; ``end`` past the last line's CRLF) as a dict of lower-case names. A
    repeated name: its values joined with ", " (``join``: a request's, as llhttp's path
    does), else the last wins (a response's). ``only_x``: the lines whose name starts
    with ``x-`` only (the rest are stepped over unread). ValueError for what is not such
    a block."""
    cdef const char* s = PyBytes_AS_STRING(raw)
    cdef Py_ssize_t ls, colon, vs, had
    cdef const char* skip
    cdef dict headers = {}
    cdef PyObject* old
    if pos < 0 or end > PyBytes_GET_SIZE(raw) or end < pos:
        raise ValueError("not a header block of this data")
    while pos < end:
        ls = pos
        if only_x and not (end - ls > 2 and (s[ls] | 0x20) == c'x' and s[ls + 1] == c'-'):
            skip = <const char*>memchr(s + pos, c'\r', end - pos)  # the line's end, unread
            if skip == NULL:
                raise ValueError("not a header block of this data")
            pos = (skip - s) + 2
            continue
        while pos < end and s[pos] != c':':
            pos += 1
        colon = pos
        pos += 1
        while pos < end and (s[pos] == c' ' or s[pos] == c'\t'):
            pos += 1
        vs = pos
        while pos < end and s[pos] != c'\r':
            pos += 1
        if pos >= end or colon == ls:
            raise ValueError("not a header block of this data")
        name = header_name(s + ls, colon - ls)
        value = short_text(s + vs, pos - vs)
        pos += 2
        if not join:
            headers[name] = value
            continue
        had = PyDict_GET_SIZE(headers)
        old = PyDict_SetDefault(headers, name, value)  # one look-up: inserted, or the earlier value
        if PyDict_GET_SIZE(headers) == had:  # (not by identity: equal values are one shared str)
            PyDict_SetItem(headers, name, <object>old + ", " + value)
    return headers


@cython.freelist(256)  # one per request: reused, not allocated and freed each time
cdef class Request:
    """One parsed HTTP request. Header names are lower case. ``gateway_headers``: False
    when the scanner saw none of the headers the gateway reads on its proxy path
    (x-velocity-*, x-request-id, x-session-id); True when it saw one or did not look."""

    def __init__(self, str method, str path, str query, dict headers, str http_version, bint keep_alive,
                 client, double received_at, bytes body=b"", bint expect_continue=False):
        self.method = method
        self.path = path
        self.query = query
        self._headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.client = client
        self.received_at = received_at
        self.body = body
        self.expect_continue = expect_continue
        self.gateway_headers = True  # not known: the gateway looks its headers up

    @property
    def headers(self):
        """Lower-case names to values (a repeated name's values joined with ", ")."""
        return self.header_dict()

    @headers.setter
    def headers(self, dict value):
        self._headers = value
        self.head_data = None

    cdef dict own_headers(self):
        """The ``x-`` headers, where the gateway's own are (x-velocity-*, x-request-id,
        x-session-id): the scanner's request makes a dict of those lines only, not of every
        header (a client that names its tenant in a header should not pay for its host and
        content-type as Python strings); otherwise the whole dict, as it is."""
        if self._headers is None and self.head_data is not None:
            return header_lines(self.head_data, self.lines_start, self.lines_end, True, True)
        return self.header_dict()

    cdef bint own_direct(self):
        """The gateway's own headers can be read with own_text: the scanner made this
        request, kept where they lie, no dict has been made since, and none is named
        twice (the dict would join the values)."""
        return self._headers is None and self.head_data is not None and not (self.own & OWN_DUP)

    cdef object own_text(self, int which):
        """The value of the gateway's header ``which`` (OWN_*), the str the dict would
        hold, or None when the request has none. Only where own_direct() is True."""
        if not (self.own & (1u << which)):
            return None
        return short_text(PyBytes_AS_STRING(self.head_data) + self.own_vs[which],
                          self.own_ve[which] - self.own_vs[which])

    cdef dict header_dict(self):
        """The headers: the scanner's request makes its dict when first asked (the
        gateway's proxy path, from most clients, never asks)."""
        if self._headers is None and self.head_data is not None:
            self._headers = header_lines(self.head_data, self.lines_start, self.lines_end, True)
            self.head_data = None
        return self._headers

    def header(self, str name, default=None):
        """The value of a header by its lower-case name."""
        return self.header_dict().get(name, default)

    def __repr__(self):
        return f"<Request {self.method} {self.path} {len(self.body)}B>"


cdef Request new_request(str method, str path, str query, dict headers, str http_version, bint keep_alive,
                         client, double received_at, bytes body):
    cdef Request r = Request.__new__(Request)
    r.method = method
    r.path = path
    r.query = query
    r._headers = headers
    r.http_version = http_version
    r.keep_alive = keep_alive
    r.client = client
    r.received_at = received_at
    r.body = body
    r.gateway_headers = True  # the scanner sets what it found
    return r
