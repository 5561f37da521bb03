# Small text work for compiled code: what an f-string or bytes % would build, without
# parsing a format at run time (a thousand instructions or more each), and a substring
# test without ``needle in hay``, which on bytes first tries the needle as an integer
# and so raises and clears a TypeError on every call (about 1,800 instructions).

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_1BYTE_DATA, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_KIND
from libc.string cimport memcmp, memcpy


cdef extern from "string.h" nogil:
    void *memmem(const void *haystack, size_t haystacklen, const void *needle, size_t needlelen)


cdef inline bint contains(bytes hay, bytes needle):
    """``needle in hay`` for bytes."""
    return memmem(PyBytes_AS_STRING(hay), PyBytes_GET_SIZE(hay),
                  PyBytes_AS_STRING(needle), PyBytes_GET_SIZE(needle)) != NULL


cdef inline int digits_before(char* end, unsigned long long u):
    """The decimal digits of ``u`` written backwards, ending just before ``end``; how many."""
    cdef int n = 0
    while True:
        n += 1
        end[-n] = <char>(48 + u % 10)
        u = u // 10
        if u == 0:
            return n


cdef inline bytes dec(long long n):
    """``n`` in decimal ASCII, as ``b"%d" % n`` gives it."""
    cdef char buf[24]
    cdef int i = 24 - digits_before(buf + 24, <unsigned long long>(-n) if n < 0 else <unsigned long long>n)
    if n < 0:
        i -= 1
        buf[i] = 45
    return PyBytes_FromStringAndSize(buf + i, 24 - i)


cdef inline bytes tenths(double x):
    """``x`` >= 0 with one decimal, as ``f"{x:.1f}"`` gives it but for exact ties
    (rounded half up here, half to even there): for header values, not for sums."""
    cdef char buf[24]
    cdef int n = put_tenths(buf, x)
    if n < 0:  # negative, NaN or huge: leave it to Python
        return f"{x:.1f}".encode("ascii")
    return PyBytes_FromStringAndSize(buf, n)


cdef inline bint latin1(str s):
    """True when ``s`` is stored one byte per character (ASCII or Latin-1): ``put`` can copy it."""
    return PyUnicode_KIND(s) == 1


cdef inline char* put(char* p, str s):
    """Copy ``s`` (``latin1(s)`` must hold) to ``p``; the position after it."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(s)
    memcpy(p, PyUnicode_1BYTE_DATA(s), n)
    return p + n


cdef inline char* put_bytes(char* p, bytes b):
    """Copy ``b`` to ``p``; the position after it."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    memcpy(p, PyBytes_AS_STRING(b), n)
    return p + n


cdef inline int put_tenths(char* out, double x):
    """``x`` >= 0 with one decimal into ``out`` (24 bytes at least), as ``tenths`` makes it;
    its length, or -1 for a value left to Python (negative, NaN or huge)."""
    cdef char buf[24]
    cdef unsigned long long t
    cdef int i
    if not (x >= 0.0) or x > 1e15:
        return -1
    t = <unsigned long long>(x * 10.0 + 0.5)
    buf[23] = <char>(48 + t % 10)
    buf[22] = 46
    i = 22 - digits_before(buf + 22, t // 10)
    memcpy(out, buf + i, 24 - i)
    return 24 - i


cdef inline bytes cat(tuple parts):
    """``b"".join(parts)`` for a tuple of bytes, without the buffer protocol join uses
    on each part (a get and a release each); TypeError for anything but bytes."""
    cdef Py_ssize_t n = 0, i, k = len(parts)
    cdef object part
    cdef bytes out
    cdef char* p
    for i in range(k):
        part = parts[i]
        if type(part) is not bytes:
            raise TypeError(f"cat() takes bytes, not {type(part).__name__}")
        n += PyBytes_GET_SIZE(part)
    out = PyBytes_FromStringAndSize(NULL, n)
    p = PyBytes_AS_STRING(out)
    for i in range(k):
        p = put_bytes(p, <bytes>parts[i])
    return out


cdef inline bint starts(str s, str prefix):
    """``s.startswith(prefix)`` without a method call, for the usual one-byte-per-character
    strings (either not: the method)."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(prefix)
    if PyUnicode_KIND(s) == 1 and PyUnicode_KIND(prefix) == 1:
        return PyUnicode_GET_LENGTH(s) >= n and memcmp(PyUnicode_1BYTE_DATA(s), PyUnicode_1BYTE_DATA(prefix), n) == 0
    return s.startswith(prefix)


cdef inline bint str_eq(str a, str b):
    """``a == b`` for two str (None equal only to None): the same object, or the same
    length, kind and bytes. Cython's ``==`` on str calls PyUnicode_Compare (~95
    instructions) once the objects differ."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    if PyUnicode_GET_LENGTH(a) != PyUnicode_GET_LENGTH(b) or PyUnicode_KIND(a) != PyUnicode_KIND(b):
        return False
    return memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), PyUnicode_GET_LENGTH(a) * PyUnicode_KIND(a)) == 0
