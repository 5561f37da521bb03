# The engine's usage read from its answer, typed (see usage.pyx).

cdef enum:
    USAGE_EVENT_LEN = 22  # len('"choices":[],"usage":{'): where usage_event_at's finds begin

cdef bint read_usage(const char* s, const char* end, long long* out) noexcept
cdef bint answer_usage(bytes body, long long* out) noexcept
cdef Py_ssize_t usage_event_at(const char* s, Py_ssize_t n, bint framed) noexcept
cdef bytes unframe(bytes framed)
