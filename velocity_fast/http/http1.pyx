"""A one-call scanner for the plain HTTP/1.1 message, in front of llhttp.

httptools (llhttp) calls back into Python once per piece of a message: the URL,
each header, the end of the head, each body piece, the end. For the message a
gateway sees nearly always (HTTP/1.1, one read holds it whole, a Content-Length
body, ordinary headers) these scanners read it in one call and return it whole.

They accept a strict subset of what llhttp accepts and decline everything else
by returning None: a head split across reads (the server takes a whole head whose body
is still coming, and fills the body in itself), chunked bodies, Expect, Upgrade,
a request with Connection: close, HTTP/1.0, a header byte outside printable ASCII, a repeated Content-Length, a head
or body past the server's limits, anything they do not recognise. The caller then
hands the same bytes to llhttp, which parses them or produces the error the
contract asks for. So a message taken here is one llhttp would have taken with the
same meaning; tests/http/test_http1_scan.py holds the two side by side.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeLatin1
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy

from velocity_fast.http.message cimport OWN_APIKEY, OWN_AUTH, OWN_DUP, OWN_N, OWN_PRIORITY, OWN_PROFILE, OWN_RID
from velocity_fast.http.message cimport OWN_SESSION, OWN_SLA
from velocity_fast.http.message cimport OWN_TENANT, Request, new_request
from velocity_fast.http.message cimport header_lines, short_text as _text

# Runs of a name's, a value's and a path's common bytes, 16 at a time (csrc/headscan.h).
cdef extern from "headscan.h" nogil:
    Py_ssize_t hs_name_run(const char* s, Py_ssize_t pos, Py_ssize_t n)
    Py_ssize_t hs_value_run(const char* s, Py_ssize_t pos, Py_ssize_t n)
    Py_ssize_t hs_path_run(const char* s, Py_ssize_t pos, Py_ssize_t n)


# RFC 9110 tchar: the bytes of a header name (and a method).
cdef bint _TCHAR[256]
cdef int _i, _at
cdef bytes _tchars = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
for _i in range(256):
    _TCHAR[_i] = False
for _i in range(len(_tchars)):
    _TCHAR[<unsigned char>_tchars[_i]] = True

# Header names the scanners must see, lower case, with the first byte as a quick filter.
cdef enum:
    H_OTHER = 0
    H_CONTENT_LENGTH = 1
    H_TRANSFER_ENCODING = 2
    H_CONNECTION = 3
    H_UPGRADE = 4
    H_EXPECT = 5
    H_CONTENT_TYPE = 6

cdef inline bint _plain8(const char* p) noexcept nogil:
    """All of p[0:8] are printable ASCII or space (0x20-0x7e): no CR, tab, other control
    byte, DEL or byte past ASCII. False can be wrong the other way (a borrow across
    bytes): the caller then looks at each byte itself."""
    cdef uint64_t x
    memcpy(&x, p, 8)
    cdef uint64_t d = x ^ 0x7f7f7f7f7f7f7f7fULL
    return ((x | ((x - 0x2020202020202020ULL) & ~x) | ((d - 0x0101010101010101ULL) & ~d))
            & 0x8080808080808080ULL) == 0


cdef inline unsigned char _lower(unsigned char c) nogil:
    if c >= 65 and c <= 90:
        return c + 32
    return c


cdef inline bint _eq_lower(const char* p, Py_ssize_t n, const char* word, Py_ssize_t wn) nogil:
    """p[:n], compared without case, equals the lower-case `word`."""
    cdef Py_ssize_t i
    if n != wn:
        return False
    for i in range(n):
        if _lower(<unsigned char>p[i]) != <unsigned char>word[i]:
            return False
    return True


cdef inline bint _is_word(const char* p, Py_ssize_t n, const char* word, Py_ssize_t wn) nogil:
    """A header name (tchars only, as the scanner has checked) equals the lower-case
    ``word`` of letters and '-', whatever its case. OR 0x20 lowers a letter, leaves '-',
    and maps no other tchar onto a letter or '-': no table, no branch per byte."""
    cdef Py_ssize_t i
    cdef uint64_t a, b
    cdef uint32_t c, d
    if n != wn:
        return False
    if n >= 8:  # eight bytes at a time, the last eight overlapping the ones before
        i = 0
        while i + 8 < n:
            memcpy(&a, p + i, 8)
            memcpy(&b, word + i, 8)
            if (a | 0x2020202020202020ULL) != b:
                return False
            i += 8
        memcpy(&a, p + n - 8, 8)
        memcpy(&b, word + n - 8, 8)
        return (a | 0x2020202020202020ULL) == b
    if n >= 4:  # the first four and the last four
        memcpy(&c, p, 4)
        memcpy(&d, word, 4)
        if (c | 0x20202020u) != d:
            return False
        memcpy(&c, p + n - 4, 4)
        memcpy(&d, word + n - 4, 4)
        return (c | 0x20202020u) == d
    for i in range(n):
        if (<unsigned char>p[i] | 0x20) != <unsigned char>word[i]:
            return False
    return True


cdef inline int _kind(const char* p, Py_ssize_t n) nogil:
    """Which of the headers the scanners must see ``p[:n]`` names (checked tchars)."""
    cdef unsigned char c = <unsigned char>p[0] | 0x20
    if c == c'c':
        if _is_word(p, n, b"content-length", 14):
            return H_CONTENT_LENGTH
        if _is_word(p, n, b"connection", 10):
            return H_CONNECTION
        if _is_word(p, n, b"content-type", 12):
            return H_CONTENT_TYPE
    elif c == c't':
        if _is_word(p, n, b"transfer-encoding", 17):
            return H_TRANSFER_ENCODING
    elif c == c'u':
        if _is_word(p, n, b"upgrade", 7):
            return H_UPGRADE
    elif c == c'e':
        if _is_word(p, n, b"expect", 6):
            return H_EXPECT
    return H_OTHER


cdef inline int _ours(const char* p, Py_ssize_t n) nogil:
    """A header the gateway reads on its proxy path: x-velocity-*, x-request-id, x-session-id
    (-1: none of them). The request says whether it has any (``Request.gateway_headers``),
    so that the proxy path need not look each up in a dict that, from most clients, has
    none of them; and where the value lies of those it reads (OWN_*; OWN_N: another
    x-velocity-* header), so that it reads them without a dict. x-api-key (OWN_APIKEY)
    is kept too, as Authorization is, for the key check where keys are required; neither
    counts as the gateway's own header."""
    if n > 11 and _is_word(p, 11, b"x-velocity-", 11):
        p += 11
        n -= 11
        if _is_word(p, n, b"tenant", 6):
            return OWN_TENANT
        if _is_word(p, n, b"priority", 8):
            return OWN_PRIORITY
        if _is_word(p, n, b"sla-ms", 6):
            return OWN_SLA
        if _is_word(p, n, b"profile", 7):
            return OWN_PROFILE
        return OWN_N
    if _is_word(p, n, b"x-request-id", 12):
        return OWN_RID
    if _is_word(p, n, b"x-session-id", 12):
        return OWN_SESSION
    if _is_word(p, n, b"x-api-key", 9):
        return OWN_APIKEY
    return -1


# "x-velocity-tenant:", the line every request of a tenant named by header starts with, as
# three 8-byte words (at 0, 8 and 10) and their masks: 0x20 where a letter may be either
# case, 0 where the byte must be as it is ('-', ':'). A match is a name of tchars, checked.
cdef bytes _TENANT_LINE = b"x-velocity-tenant:"
cdef uint64_t _TENANT_WORD[3]
cdef uint64_t _TENANT_MASK[3]
cdef bytes _masks = bytes(0x20 if 97 <= c <= 122 else 0 for c in _TENANT_LINE)
for _i, _at in enumerate((0, 8, 10)):
    memcpy(&_TENANT_WORD[_i], <const char*>_TENANT_LINE + _at, 8)
    memcpy(&_TENANT_MASK[_i], <const char*>_masks + _at, 8)


cdef inline bint _tenant_line(const char* p) noexcept nogil:
    """``p[:18]`` (there are 18) is ``x-velocity-tenant:``, the name in any case: three word
    compares instead of the name's scan a byte at a time and the look at what it names."""
    cdef uint64_t a, b, c
    memcpy(&a, p, 8)
    memcpy(&b, p + 8, 8)
    memcpy(&c, p + 10, 8)
    return ((a | _TENANT_MASK[0]) == _TENANT_WORD[0] and (b | _TENANT_MASK[1]) == _TENANT_WORD[1]
            and (c | _TENANT_MASK[2]) == _TENANT_WORD[2])


cdef int _connection(const char* p, Py_ssize_t n) nogil:
    """1 keep-alive, 0 close, -1 anything else (a token list, upgrade...)."""
    if _eq_lower(p, n, b"keep-alive", 10):
        return 1
    if _eq_lower(p, n, b"close", 5):
        return 0
    return -1


cdef Py_ssize_t _digits(const char* p, Py_ssize_t n) nogil:
    """A Content-Length value: only digits, at most 15 of them; else -1."""
    cdef Py_ssize_t i, v = 0
    if n == 0 or n > 15:
        return -1
    for i in range(n):
        if p[i] < c'0' or p[i] > c'9':
            return -1
        v = v * 10 + (p[i] - c'0')
    return v


cdef int _headers(const char* s, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t limit, Head* out,
                  bint request) except -2:
    """Header lines from s[pos] up to the empty line: 0 taken, -1 declined or incomplete.

    No dict is made: the request's is made when first read (``Request.headers``, a
    repeated name's values joined with ", "), the response's if asked
    (response_headers, the last of a repeated name winning, as on llhttp's path). A
    request's Transfer-Encoding is declined; a response's one ``chunked`` is taken.
    Where Content-Type's value lies is kept; for a request, whether it names a header
    the gateway reads (``ours``). ``s`` is a bytes object's data: the NUL CPython keeps
    after it ends the scan of a name or value there."""
    cdef Py_ssize_t ls, colon, vs, ve, cl = -1
    cdef int kind, keep = -2, c, own
    cdef bint chunked = False
    cdef unsigned char ch
    out.ct_start = -1
    out.ct_len = 0
    out.ours = False
    out.own = 0
    while True:
        if pos + 1 >= n or pos >= limit:
            return -1
        if s[pos] == c'\r':
            if s[pos + 1] != c'\n':
                return -1
            pos += 2
            break
        ls = pos
        own = -1
        if request and n - pos > 18 and (s[pos] == c'x' or s[pos] == c'X') and _tenant_line(s + pos):
            pos += 17  # (at its ':')
            own = OWN_TENANT
        else:
            # name: one or more tchar, then ':' at once (no space before it). The bytes
            # object ends in a NUL (CPython keeps one past every bytes' data), which is no
            # tchar, space or tab: these loops stop at the end without a bounds test.
            pos = hs_name_run(s, pos, n)  # letters, digits, '-': the rest by the table
            while _TCHAR[<unsigned char>s[pos]]:
                pos += 1
            if pos == ls or pos >= n or s[pos] != c':':
                return -1
        colon = pos
        pos += 1
        while s[pos] == c' ' or s[pos] == c'\t':
            pos += 1
        vs = pos
        # value: printable ASCII, space or tab, up to CRLF (leading spaces skipped above);
        # sixteen, then eight bytes at a time while all are plain (no control byte, DEL
        # or high bit)
        pos = hs_value_run(s, pos, n)
        while pos + 8 <= n and _plain8(s + pos):
            pos += 8
        while True:  # (the NUL at the end is refused here: a control byte)
            ch = <unsigned char>s[pos]
            if ch == c'\r':
                break
            if (ch < 0x20 and ch != c'\t') or ch >= 0x7f:
                return -1
            pos += 1
        if pos + 1 >= n or s[pos + 1] != c'\n':
            return -1
        ve = pos  # trailing spaces stay part of the value, as llhttp leaves them
        pos += 2
        kind = _kind(s + ls, colon - ls) if own < 0 else H_OTHER
        if kind == H_CONTENT_LENGTH:
            if cl != -1:
                return -1
            cl = _digits(s + vs, ve - vs)
            if cl < 0:
                return -1
        elif kind == H_CONNECTION:
            c = _connection(s + vs, ve - vs)
            if c < 0 or keep != -2:
                return -1
            keep = c
        elif kind == H_TRANSFER_ENCODING and not request and not chunked \
                and _eq_lower(s + vs, ve - vs, b"chunked", 7):
            chunked = True
        elif kind == H_CONTENT_TYPE:
            out.ct_start = vs
            out.ct_len = ve - vs
        elif kind != H_OTHER:
            return -1  # other transfer codings, upgrade, expect: llhttp's
        if request and (s[ls] == c'x' or s[ls] == c'X' or (
                (s[ls] == c'a' or s[ls] == c'A') and _is_word(s + ls, colon - ls, b"authorization", 13))):
            kind = own if own >= 0 else (_ours(s + ls, colon - ls) if s[ls] != c'a' and s[ls] != c'A'
                                         else OWN_AUTH)
            if kind >= 0:
                if kind != OWN_AUTH and kind != OWN_APIKEY:
                    out.ours = True  # (the key's headers are read only where keys are required)
                if kind < OWN_N:
                    if out.own & (1u << kind):
                        out.own |= OWN_DUP  # the dict joins a repeated name's values: it reads them
                    else:
                        out.own |= 1u << kind
                        out.own_vs[kind] = vs
                        out.own_ve[kind] = ve
    if pos > limit:
        return -1
    if chunked and cl != -1:
        return -1  # both framings: llhttp's error to give
    out.content_length = cl
    out.keep_alive = keep
    out.chunked = chunked
    out.end = pos
    return 0


def response_headers(bytes data, Py_ssize_t pos, Py_ssize_t end):
    """The header lines of a response the scanner took (from ``pos``, the line after the
    status line, to ``end``, past the blank line) as a dict: lower-case names, the last
    of a repeated name winning, as UpstreamConnection keeps llhttp's."""
    if data is None:
        raise TypeError("response_headers() needs bytes, not None")
    return header_lines(data, pos, end - 2, False)  # (the blank line is not a header line)


def scan_request(bytes data, Py_ssize_t pos, Py_ssize_t max_head, Py_ssize_t max_body):
    """The plain HTTP/1.1 request that starts at ``data[pos]`` and is whole in ``data``:
    (method, path, query, headers, keep_alive, body, end), or None (llhttp's turn).

    ``headers``: lower-case names to values, repeats joined with ", " (as the server
    does); ``end``: where the next request starts; ``max_head`` and ``max_body``: the
    server's limits, past which llhttp's path answers 431 or 413.
    """
    cdef Py_ssize_t end = 0
    cdef Request r = take_request(data, pos, max_head, max_body, None, 0.0, &end)
    if r is None:
        return None
    return (r.method, r.path, r.query, r.headers, r.keep_alive, r.body, end)


cdef Request take_request(bytes data, Py_ssize_t pos, Py_ssize_t max_head, Py_ssize_t max_body, client,
                          double received_at, Py_ssize_t* end, Py_ssize_t* have=NULL):
    """scan_request for the server, as C: the Request itself (HTTP/1.1, ``client`` and
    ``received_at`` as given), ``end`` set where the next request starts; or None.

    With ``have``, a whole head whose body has not all come is taken too: the Request's
    body is then a bytes object of the body's full length (Content-Length, within
    ``max_body``) holding the ``have[0]`` bytes that came, and ``end`` is the end of
    ``data``; the caller fills in the rest as it arrives (one copy, no llhttp). A whole
    request sets ``have[0]`` to its body's length."""
    if data is None:
        raise TypeError("take_request() needs bytes, not None")
    return _take(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), data, pos, max_head, max_body, client,
                 received_at, end, have)


cdef Request take_request_at(const char* s, Py_ssize_t n, Py_ssize_t max_head, Py_ssize_t max_body, client,
                             double received_at, Py_ssize_t* end, Py_ssize_t* have):
    """take_request over the ``n`` bytes at ``s`` (a read buffer, from its start), which
    nothing keeps: the body is copied out of it once, and the head's lines for the header
    dict (made only if asked) into a bytes object of their own."""
    return _take(s, n, None, 0, max_head, max_body, client, received_at, end, have)


cdef Request _take(const char* s, Py_ssize_t n, bytes data, Py_ssize_t pos, Py_ssize_t max_head,
                   Py_ssize_t max_body, client, double received_at, Py_ssize_t* end, Py_ssize_t* have):
    """take_request's scan; ``data`` the bytes ``s`` lies in, or None (a buffer)."""
    cdef Py_ssize_t ms, us, ue, q, limit, body_end, cl, start = pos
    cdef Head head
    cdef Request req
    if pos >= n:
        return None
    limit = pos + max_head
    # method: 1-16 upper-case letters
    ms = pos
    while pos < n and pos - ms < 16 and s[pos] >= c'A' and s[pos] <= c'Z':
        pos += 1
    if pos == ms or pos >= n or s[pos] != c' ':
        return None
    method = _text(s + ms, pos - ms)
    pos += 1
    # request-target in origin form: '/' then visible ASCII
    us = pos
    if pos >= n or s[pos] != c'/':
        return None
    q = -1
    pos = hs_path_run(s, pos, n)  # up to a '?' or the end, 16 bytes at a time
    while pos < n and <unsigned char>s[pos] > 0x20 and <unsigned char>s[pos] < 0x7f:
        if s[pos] == c'?' and q < 0:
            q = pos
        pos += 1
    ue = pos
    if pos + 10 > n or s[pos] != c' ':
        return None
    if not (s[pos + 1] == c'H' and s[pos + 2] == c'T' and s[pos + 3] == c'T' and s[pos + 4] == c'P'
            and s[pos + 5] == c'/' and s[pos + 6] == c'1' and s[pos + 7] == c'.' and s[pos + 8] == c'1'
            and s[pos + 9] == c'\r'):
        return None
    pos += 10
    if pos >= n or s[pos] != c'\n':
        return None
    pos += 1
    head.lines = pos
    if _headers(s, pos, n, limit, &head, True) < 0:
        return None
    if head.keep_alive == 0:
        # Connection: close: llhttp refuses what the client sends after it, and the
        # server answers that refusal; the rarely-seen case stays entirely llhttp's.
        return None
    cl = head.content_length
    if cl < 0:
        cl = 0
    if cl > max_body:
        return None
    body_end = head.end + cl
    if body_end > n and have == NULL:
        return None
    if q >= 0:
        path = _text(s + us, q - us)
        query = PyUnicode_DecodeLatin1(s + q + 1, ue - q - 1, NULL)
    else:
        path = _text(s + us, ue - us)
        query = ""
    if cl == 0:
        body = b""
    elif body_end > n:  # the rest of the body is still coming
        body = PyBytes_FromStringAndSize(NULL, cl)
        memcpy(PyBytes_AS_STRING(body), s + head.end, n - head.end)
        body_end = n
    else:
        body = PyBytes_FromStringAndSize(s + head.end, cl)
    if have != NULL:
        have[0] = body_end - head.end
    end[0] = body_end
    req = new_request(method, path, query, None, "1.1", head.keep_alive != 0, client, received_at, body)
    if data is not None:
        req.head_data = data  # the header dict is made from it if asked
        req.lines_start = head.lines
        req.lines_end = head.end - 2
    else:
        req.head_data = PyBytes_FromStringAndSize(s + start, head.end - start)
        req.lines_start = head.lines - start
        req.lines_end = head.end - 2 - start
    req.gateway_headers = head.ours
    req.own = head.own
    if head.own:
        if data is not None:
            start = 0  # (in a buffer's copy of the head, the offsets are from its start)
        for q in range(OWN_N):
            if head.own & (1u << q):
                req.own_vs[q] = head.own_vs[q] - start
                req.own_ve[q] = head.own_ve[q] - start
    return req


cdef int _status_line(const char* s, Py_ssize_t pos, Py_ssize_t n, Py_ssize_t* end) noexcept nogil:
    """An HTTP/1.1 status line with a final status that has a body (not 1xx, 204 or 304):
    the status, ``end`` set past the line's CRLF; -1 declined or incomplete."""
    cdef int status
    cdef unsigned char ch
    if pos + 13 > n:
        return -1
    if not (s[pos] == c'H' and s[pos + 1] == c'T' and s[pos + 2] == c'T' and s[pos + 3] == c'P'
            and s[pos + 4] == c'/' and s[pos + 5] == c'1' and s[pos + 6] == c'.' and s[pos + 7] == c'1'
            and s[pos + 8] == c' '):
        return -1
    pos += 9
    if not (c'1' <= s[pos] <= c'5' and c'0' <= s[pos + 1] <= c'9' and c'0' <= s[pos + 2] <= c'9'):
        return -1
    status = (s[pos] - c'0') * 100 + (s[pos + 1] - c'0') * 10 + (s[pos + 2] - c'0')
    if status < 200 or status == 204 or status == 304:
        return -1
    pos += 3
    if s[pos] != c' ' and s[pos] != c'\r':
        return -1
    while pos < n and s[pos] != c'\r':
        ch = <unsigned char>s[pos]
        if (ch < 0x20 and ch != c'\t') or ch == 0x7f:
            return -1
        pos += 1
    if pos + 1 >= n or s[pos + 1] != c'\n':
        return -1
    end[0] = pos + 2
    return status


cdef int take_response(bytes data, Py_ssize_t pos, Head* out) except -2:
    """The head of a plain HTTP/1.1 response that starts at ``data[pos]``, whole in
    ``data``: its status, ``out`` filled in (``lines``: where the header lines start,
    ``end``: where the body starts); -1 declined (llhttp's turn). The caller checks the
    framing: a Content-Length body (``content_length`` >= 0) or chunked (``chunked``)."""
    cdef const char* s
    cdef Py_ssize_t n
    cdef int status
    if data is None:
        raise TypeError("take_response() needs bytes, not None")
    s = PyBytes_AS_STRING(data)
    n = PyBytes_GET_SIZE(data)
    status = _status_line(s, pos, n, &pos)
    if status < 0:
        return -1
    out.lines = pos
    if _headers(s, pos, n, n, out, False) < 0:
        return -1
    out.status = status
    return status


def scan_response(bytes data, Py_ssize_t pos):
    """The plain HTTP/1.1 response that starts at ``data[pos]`` and is whole in ``data``,
    with a Content-Length body: (status, headers, keep_alive, body, end), or None.

    1xx, 204 and 304 (no body by their status), chunked or close-delimited bodies are
    llhttp's; ``headers`` maps lower-case names to values (response_headers).
    """
    cdef Head head
    cdef Py_ssize_t body_end
    if take_response(data, pos, &head) < 0 or head.content_length < 0:
        return None
    body_end = head.end + head.content_length
    if body_end > PyBytes_GET_SIZE(data):
        return None
    return (head.status, response_headers(data, head.lines, head.end), head.keep_alive != 0,
            data[head.end:body_end], body_end)


def scan_chunked_head(bytes data, Py_ssize_t pos):
    """The head of a plain HTTP/1.1 response with a chunked body (a stream), whole in
    ``data`` from ``pos``: (status, headers, keep_alive, end), ``end`` where the first
    chunk starts; None for anything else (scan_response's rules otherwise)."""
    cdef Head head
    if take_response(data, pos, &head) < 0 or not head.chunked:
        return None
    return (head.status, response_headers(data, head.lines, head.end), head.keep_alive != 0, head.end)
