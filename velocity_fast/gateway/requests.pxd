from cpython.object cimport PyObject

# Decoding client requests, what compiled callers call as C (see requests.pyx for the why).

cpdef decode_proxy(bytes body, bint chat)
cpdef bytes strip_own_fields(bytes body, r)
cpdef bytes ask_usage(bytes body, bint has_options)

# ProxyRequest's fields, for proxy_field (the order of its declaration).
cdef enum:
    P_MODEL = 0
    P_MESSAGES = 1
    P_PROMPT = 2
    P_STREAM = 3
    P_STREAM_OPTIONS = 4
    P_MAX_TOKENS = 5
    P_MAX_COMPLETION_TOKENS = 6
    P_PRIORITY = 7
    P_SLA_MS = 8
    P_USER = 9
    P_FIELDS = 10

cdef object proxy_field(object r, int which)
cdef object decode_fields(bytes body, bint chat, PyObject** f, bint* compact)
cdef object take_digests(object r)
