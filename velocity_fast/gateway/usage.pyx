"""What the gateway reads of an engine's answer for its books, in C and in one pass: the
usage (prompt, cached and completion tokens) at the end of a whole answer and in a
stream's final usage chunk, and a piece of whole HTTP chunks as its data (the piece that
holds the usage chunk, when that chunk is cut out). gateway/exchange.pyx calls them as C.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp, memcpy

cdef extern from "string.h":
    void* memrchr(const void* s, int c, size_t n) nogil


cdef inline bint _key_is(const char* k, Py_ssize_t n, const char* name, Py_ssize_t m) noexcept:
    return n == m and memcmp(k, name, m) == 0


cdef long long _NUMBER_MAX = 1000000000000000  # (a C constant: a literal this long is compared as a Python int)


cdef inline const char* _number(const char* p, const char* end, long long* v) noexcept:
    """The digits at ``p`` into ``v``; the byte after them, or NULL when there are none."""
    cdef long long n = 0
    cdef const char* start = p
    while p < end and p[0] >= c'0' and p[0] <= c'9' and n < _NUMBER_MAX:
        n = n * 10 + (p[0] - c'0')
        p += 1
    v[0] = n
    return p if p > start else NULL


cdef inline bint _same(const char* a, const char* b, Py_ssize_t n) noexcept:
    """a[:n] == b[:n] for n >= 8, eight bytes at a time (the last eight overlapping the
    ones before): inlined where n is a constant, no memcmp call; up to 24 bytes, the
    words' differences or-ed, one branch."""
    cdef uint64_t x, y, d
    cdef Py_ssize_t i = 0
    if n <= 24:
        memcpy(&x, a, 8)
        memcpy(&y, b, 8)
        d = x ^ y
        memcpy(&x, a + n - 8, 8)
        memcpy(&y, b + n - 8, 8)
        d |= x ^ y
        if n > 16:
            memcpy(&x, a + 8, 8)
            memcpy(&y, b + 8, 8)
            d |= x ^ y
        return d == 0
    while i + 8 < n:
        memcpy(&x, a + i, 8)
        memcpy(&y, b + i, 8)
        if x != y:
            return False
        i += 8
    memcpy(&x, a + n - 8, 8)
    memcpy(&y, b + n - 8, 8)
    return x == y


cdef inline const char* _member(const char* p, const char* end, const char* key, Py_ssize_t klen,
                                long long* v) noexcept:
    """``key`` (with its quotes, colon and the comma before it) then a number at ``p``."""
    if end - p <= klen or not _same(p, key, klen):
        return NULL
    return _number(p + klen, end, v)


cdef bint read_usage(const char* s, const char* end, long long* out) noexcept:
    """The usage object that opens at ``s`` (its ``{``): its prompt, cached (0 when not
    reported) and completion tokens into ``out[3]``. vLLM writes it compact and in one
    order, read as such; anything else is walked (_walk_usage)."""
    cdef const char* p = s
    cdef long long total
    p = _member(p, end, b'{"prompt_tokens":', 17, &out[0])
    if p != NULL:
        p = _member(p, end, b',"total_tokens":', 16, &total)
    if p != NULL:
        p = _member(p, end, b',"completion_tokens":', 21, &out[2])
    if p != NULL and p < end:
        if p[0] == c'}':
            out[1] = 0
            return True
        if _member(p, end, b',"prompt_tokens_details":{"cached_tokens":', 41, &out[1]) != NULL:
            return True
    return _walk_usage(s, end, out)


cdef bint _walk_usage(const char* s, const char* end, long long* out) noexcept:
    """The usage object that opens at ``s`` (its ``{``), walked once: its prompt, cached (0
    when not reported) and completion tokens into ``out[3]`` (input_tokens and
    output_tokens count as prompt and completion: the Responses and Messages APIs). False when it does not
    close before ``end`` or lacks the counts. Its members are numbers and objects of
    numbers (prompt_tokens_details): no string value to skip."""
    cdef int depth = 0
    cdef const char* p = s
    cdef const char* k
    cdef Py_ssize_t klen
    cdef long long v
    cdef char c
    out[0] = out[2] = -1
    out[1] = 0
    while p < end:
        c = p[0]
        if c == c'{':
            depth += 1
        elif c == c'}':
            depth -= 1
            if depth == 0:
                return out[0] >= 0 and out[2] >= 0
        elif c == c'"':
            k = p + 1
            p = k
            while p < end and p[0] != c'"':
                p += 1
            klen = p - k
            p += 1
            while p < end and (p[0] == c' ' or p[0] == c':'):
                p += 1
            if p < end and p[0] >= c'0' and p[0] <= c'9':
                v = 0
                while p < end and p[0] >= c'0' and p[0] <= c'9' and v < _NUMBER_MAX:
                    v = v * 10 + (p[0] - c'0')
                    p += 1
                if _key_is(k, klen, b"prompt_tokens", 13):
                    out[0] = v
                elif _key_is(k, klen, b"completion_tokens", 17):
                    out[2] = v
                elif _key_is(k, klen, b"cached_tokens", 13):
                    out[1] = v
                # The Responses and Messages APIs' usage (gateway/routes.py's routes).
                elif _key_is(k, klen, b"input_tokens", 12):
                    out[0] = v
                elif _key_is(k, klen, b"output_tokens", 13):
                    out[2] = v
                elif _key_is(k, klen, b"cache_read_input_tokens", 23):
                    out[1] = v
            continue
        p += 1
    return False


# vLLM ends a whole answer with its usage and a few members of null: it is in this tail.
cdef Py_ssize_t _USAGE_TAIL = 2048


cdef const char* _usage_back(const char* low, const char* e) noexcept:
    """The last ``"usage":`` in [low, e): the byte after it, or NULL. Found by its 'g' from
    the end (memrchr): no key of a usage object has one, and what vLLM writes after it
    few (prompt_logprobs)."""
    cdef const char* p
    while e > low:
        p = <const char*>memrchr(low, c'g', e - low)
        if p == NULL:
            return NULL
        if p - low >= 4 and _same(p - 4, b'"usage":', 8):
            return p + 4
        e = p
    return NULL


cdef bint answer_usage(bytes body, long long* out) noexcept:
    """A whole answer's usage (the last ``"usage":{`` of its tail) into ``out[3]``."""
    cdef const char* s = PyBytes_AS_STRING(body)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef const char* end = s + n
    cdef const char* p = _usage_back(s + (n - _USAGE_TAIL if n > _USAGE_TAIL else 0), end)
    if p == NULL:
        return False
    while p < end and p[0] == c' ':
        p += 1
    return p < end and p[0] == c'{' and read_usage(p, end, out)


def body_usage(bytes body):
    """(prompt, cached, completion) tokens of a whole answer's usage, or None (tests)."""
    cdef long long u[3]
    return (u[0], u[1], u[2]) if answer_usage(body, u) else None


# A stream's final usage chunk, as vLLM (and the sim) write it: no choices, then usage.
cdef const char* _USAGE_EVENT = b'"choices":[],"usage":{'


cdef inline bint _hex_digit(char c) noexcept:
    return (c'0' <= c <= c'9') or (c'a' <= c <= c'f') or (c'A' <= c <= c'F')


cdef Py_ssize_t usage_event_at(const char* s, Py_ssize_t n, bint framed) noexcept:
    """Where a stream's final usage chunk begins its ``"choices":[],"usage":{`` in a
    piece, or -1. Only the piece's last event is looked at, or the one before a closing
    [DONE] (vLLM sends usage last): and only when it ends as a usage chunk does, with two
    closing braces (a token's chunk ends with its choices, ``]}``). ``framed``: whole
    HTTP chunks, framing and all."""
    cdef Py_ssize_t e = n
    cdef const char* p
    if framed and e >= 2 and s[e - 2] == c'\r':
        e -= 2
    if e >= 14 and memcmp(s + e - 14, b"data: [DONE]\n\n", 14) == 0:
        e -= 14
        if framed and e >= 2 and s[e - 2] == c'\r':  # the framing of [DONE]'s own chunk
            e -= 2
            while e > 0 and _hex_digit(s[e - 1]):
                e -= 1
            if e >= 2 and s[e - 1] == c'\n':
                e -= 2
    # The usage object closes the event (`}}`), or a string member follows it: vLLM 0.32
    # ends the chunk with its "system_fingerprint". A token's chunk ends `]}`: skipped here.
    if e < 4 or memcmp(s + e - 3, b"}\n\n", 3) != 0 or (s[e - 4] != c'}' and s[e - 4] != c'"'):
        return -1
    p = _usage_back(s + (e - 2048 if e > 2048 else 0), s + e)
    if p != NULL and p - s >= USAGE_EVENT_LEN - 1 and memcmp(p - USAGE_EVENT_LEN + 1, _USAGE_EVENT,
                                                              USAGE_EVENT_LEN) == 0 \
            and memchr(p, c'\n', (s + e - 2) - p) == NULL:  # in the last event, not an earlier one
        return p - s - USAGE_EVENT_LEN + 1
    return -1


cdef bytes unframe(bytes framed):
    """The data of whole HTTP chunks (size line, data, CRLF each), joined."""
    cdef const char* s = PyBytes_AS_STRING(framed)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(framed), pos = 0, size, w = 0
    cdef int h
    cdef char* q
    out = PyBytes_FromStringAndSize(NULL, n)
    q = PyBytes_AS_STRING(out)
    while pos < n:
        size = 0
        while pos < n and s[pos] != c'\r':
            h = s[pos]
            if c'0' <= h <= c'9':
                size = size * 16 + h - c'0'
            elif c'a' <= h <= c'f':
                size = size * 16 + h - c'a' + 10
            elif c'A' <= h <= c'F':
                size = size * 16 + h - c'A' + 10
            else:  # an extension: skipped to the end of the line
                while pos < n and s[pos] != c'\r':
                    pos += 1
                break
            pos += 1
        pos += 2
        if size > n - pos:
            size = n - pos if n > pos else 0
        memcpy(q + w, s + pos, size)
        w += size
        pos += size + 2
    return out[:w]
