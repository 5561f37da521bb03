"""Decoding client requests, compiled: decode_proxy and strip_own_fields run on every
proxied request (ingress.pyx's ``proxy`` calls them as C), decode_generate on /generate.

Only the fields the gateway needs are decoded; the body is forwarded as is unless it
carries the gateway's own fields. A body of 3 KiB or more is first scanned in C
(csrc/reqscan.h: one strict pass, SIMD inside strings, no object made): msgspec then
decodes only the members the gateway reads, the prompt stays a span of the body, and
the gateway's own members are cut out by their spans. What the scanner does not take
is decoded whole, as a small body is, so errors read the same either way. This is the one request decoder: the msgspec Structs
it decodes into are declared in gateway/request_types.py (a schema, no code), and its
errors are gateway/errors.py's BadRequest.
"""

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from velocity_fast.lowlevel.fmt cimport contains
from velocity_fast.lowlevel.slots cimport slot, slot_offset
from velocity_fast.routing.prefix cimport BlockDigests, digest_seed, new_digests

import os

import msgspec

from velocity_fast.gateway.errors import BadRequest
from velocity_fast.gateway.request_types import GATEWAY_FIELDS, MAX_TOKENS_LIMIT, GenerateRequest, ProxyRequest

cdef extern from "reqscan.h":
    int VR_MESSAGES
    int VR_PROMPT
    ctypedef struct vr_member:
        size_t ks
        size_t vs
        size_t ve
        int field
        int spaced
    ctypedef struct vr_object:
        int n
        int messages
        int prompt
        int own
        size_t read_bytes
        vr_member m[64]
    ctypedef struct vr_digests:
        uint64_t *d
        uint64_t *s
        uint64_t state
        size_t n
        int field
        size_t vs
        size_t ve
    int vr_scan(const unsigned char *data, size_t length, vr_object *out, vr_digests *dg) nogil
    size_t vr_reduce(const unsigned char *data, const vr_object *o, unsigned char *dst) nogil
    size_t vr_strip_len(const vr_object *o) nogil
    void vr_strip(const unsigned char *data, const vr_object *o, unsigned char *dst) nogil
    size_t vr_compact(const unsigned char *data, size_t length, unsigned char *dst) nogil
    int vr_set_isa(int isa) nogil

# The GIL is let go for a walk over at least this many bytes: below it, letting go and
# taking it back (two locks and a signal) costs more than another thread could gain.
cdef size_t _NOGIL_MIN = 65536

# Bodies from this size on are scanned first: below it one msgspec decode is cheaper
# than a scan and a decode of the members read (they cross between 2 and 4 KiB).
cdef Py_ssize_t _SCAN_MIN = 3072

_proxy_decoder = msgspec.json.Decoder(ProxyRequest)
_generate_decoder = msgspec.json.Decoder(GenerateRequest)
_raw_object_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])

cdef object _UNSET = msgspec.UNSET  # a field the body did not name
cdef long long _MAX_TOKENS = MAX_TOKENS_LIMIT


cdef inline bint _tokens_ok(object v) except -1:
    """A decoded token count (an int: msgspec refuses bools and floats) within
    1..MAX_TOKENS_LIMIT, read as a C number: no Python comparison."""
    cdef int overflow = 0
    cdef long long n = PyLong_AsLongLongAndOverflow(v, &overflow)
    return overflow == 0 and 1 <= n <= _MAX_TOKENS


def _tokens_error(str name, v):
    if v < 1:
        return BadRequest(f"`{name}` must be at least 1, got {v}.", name)
    return BadRequest(f"`{name}` must be at most {MAX_TOKENS_LIMIT}.", name)

# ProxyRequest's fields by offset (slots.pxd), in the order of requests.pxd's P_* names.
cdef Py_ssize_t _OFFSETS[P_FIELDS]
cdef object _PROXY_TYPE = ProxyRequest
cdef int _i
_NAMES = ("model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
          "priority", "sla_ms", "user")  # P_MODEL... in order
if ProxyRequest.__struct_fields__ != _NAMES:
    raise ImportError("ProxyRequest's fields and requests.pxd's P_* names differ")
for _i in range(P_FIELDS):
    _OFFSETS[_i] = slot_offset(ProxyRequest, _NAMES[_i])


cdef object proxy_field(object r, int which):
    """Field ``which`` (P_MODEL...) of a ProxyRequest, read at its slot offset: from
    compiled code ``r.model`` is a type look-up and a descriptor call."""
    if type(r) is not _PROXY_TYPE:
        raise TypeError(f"proxy_field() needs a ProxyRequest, not {type(r).__name__}")
    return slot(r, _OFFSETS[which])


cdef int proxy_fields(object r, PyObject** out) except -1:
    """Every field of a ProxyRequest at once, into ``out[P_FIELDS]`` (borrowed: alive
    while ``r`` is): one call and one type check where proxy_field makes one per field."""
    cdef int i
    cdef PyObject* v
    if type(r) is not _PROXY_TYPE:
        raise TypeError(f"proxy_fields() needs a ProxyRequest, not {type(r).__name__}")
    for i in range(P_FIELDS):
        v = (<PyObject**>((<char*><PyObject*>r) + _OFFSETS[i]))[0]
        if v == NULL:
            raise AttributeError(f"ProxyRequest.{_NAMES[i]} is not set")
        out[i] = v
    return 0


@cython.boundscheck(True)
@cython.wraparound(True)
def _explain(e):
    """The 400 for a msgspec.DecodeError, with the field it names as ``param``."""
    text = str(e)
    param = None
    if "$." in text:
        param = text.rsplit("$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] or None
    elif "missing required field `" in text:  # at the top level msgspec names the field, not a path
        param = text.split("missing required field `", 1)[1].split("`", 1)[0] or None
    if isinstance(e, msgspec.ValidationError):
        if param in ("max_tokens", "max_completion_tokens") and text.startswith("Expected `int` <="):
            return BadRequest(f"`{param}` must be at most {MAX_TOKENS_LIMIT}.", param)
        return BadRequest(f"Invalid request: {text}", param)
    return BadRequest(f"The request body is not valid JSON: {text}")


cdef object _proxy_decode = _proxy_decoder.decode  # bound once: no method look-up per request
cdef object _generate_decode = _generate_decoder.decode
cdef object _Raw = msgspec.Raw
cdef object _DecodeError = msgspec.DecodeError

# The body without the gateway's own members, cut by the decoder's scan of a large body
# that names them, for the strip_own_fields that follows (one body at most, so a large
# body is not scanned twice): the body it was cut from, and the result.
cdef object _cut_from = None
cdef object _cut = None
# The digests of the prompt's blocks the decoder's scan made (csrc/reqscan.h), for the
# router's hashes of that request (take_digests): the request they are of, and them.
cdef object _digests_of = None
cdef object _digests = None


cdef object take_digests(object r):
    """The BlockDigests the scan of r's body made of its prompt member (None when r is not
    the last request scanned, or its prompt was not digested): taken once."""
    global _digests_of, _digests
    if r is not _digests_of:
        return None
    out = _digests
    _digests_of = _digests = None
    return out


cdef object _scanned(bytes body):
    """The ProxyRequest of a body the request scanner takes, else None (the caller then
    decodes it whole): the members it reads decoded from a small object made of them,
    ``messages`` and ``prompt`` set to spans of ``body`` (msgspec.Raw over a memoryview:
    no copy)."""
    global _cut_from, _cut, _digests_of, _digests
    cdef vr_object o
    cdef vr_digests dg
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(body)
    cdef size_t n = <size_t>PyBytes_GET_SIZE(body)
    cdef size_t size
    cdef int rc
    cdef BlockDigests digests = new_digests(<Py_ssize_t>(n // 64 + 1))
    dg.d = digests.d
    dg.s = digests.s
    dg.state = digests.guess = digest_seed()
    if n >= _NOGIL_MIN:
        with nogil:
            rc = vr_scan(p, n, &o, &dg)
    else:
        rc = vr_scan(p, n, &o, &dg)
    if rc < 0:
        return None
    size = o.read_bytes + 1 if o.read_bytes else 2
    reduced = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
    if vr_reduce(p, &o, <unsigned char *>PyBytes_AS_STRING(reduced)) != size:
        raise SystemError("vr_reduce wrote other than its size")
    try:
        r = _proxy_decode(reduced)
    except (_DecodeError, RecursionError):
        return None  # decoded whole, the error names what the client sent
    if o.own:
        _cut = _strip(p, &o)
        _cut_from = body
    if o.messages >= 0:
        r.messages = _compact_raw(body, &o.m[o.messages])
    if o.prompt >= 0:
        r.prompt = _compact_raw(body, &o.m[o.prompt])
    if dg.field >= 0:
        digests.n = <Py_ssize_t>dg.n
        digests.length = <Py_ssize_t>(dg.ve - dg.vs)
        digests.prompt = dg.field == VR_PROMPT
        _digests_of = r
        _digests = digests
    return r


cdef bytes _strip(const unsigned char *p, const vr_object *o):
    """The body at p without the members vr_scan found to be the gateway's own."""
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>vr_strip_len(o))
    vr_strip(p, o, <unsigned char *>PyBytes_AS_STRING(out))
    return out


cdef object _compact_raw(bytes body, const vr_member *m):
    """A member's value as msgspec.Raw of compact JSON text (no whitespace between its
    tokens: what the router's hash_json then hashes without a walk): a view of the body
    when the client wrote it so, else a compacted copy."""
    cdef size_t n = m.ve - m.vs
    cdef const unsigned char *src = <const unsigned char *>PyBytes_AS_STRING(body) + m.vs
    if not m.spaced:
        return _Raw(memoryview(body)[m.vs:m.ve])
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>n)
    n = vr_compact(src, n, <unsigned char *>PyBytes_AS_STRING(out))
    return _Raw(memoryview(out)[:n])


_ISAS = ("sse2", "avx2", "avx512")


def scan_isa(str which="auto") -> str:
    """The string walk the request scanner uses from now on: "avx512" (AVX-512 BW),
    "avx2", "sse2", or "auto" (the CPU's best, the default); a walk the CPU lacks gives
    the best below it. Returns the one in use. For tests and benchmarks: every walk must
    take and refuse the same bodies."""
    if which != "auto" and which not in _ISAS:
        raise ValueError(f"scan_isa: {which!r} is not auto, avx512, avx2 or sse2")
    return _ISAS[vr_set_isa(-1 if which == "auto" else _ISAS.index(which))]


# VELOCITY_SCAN_ISA=sse2 (or avx2, avx512, auto) picks the walk at start, as simdjson's
# SIMDJSON_FORCE_IMPLEMENTATION does: to compare them on one machine, or to step
# around a CPU the detection misjudges.
if os.environ.get("VELOCITY_SCAN_ISA", "auto") in _ISAS:
    scan_isa(os.environ["VELOCITY_SCAN_ISA"])


def scan_members(bytes body):
    """What the request scanner makes of ``body``: its top-level members as (key start,
    value start, value end) offsets, or None when it does not take it (for tests: the
    decoder's own use is _scanned)."""
    cdef vr_object o
    cdef int i
    if vr_scan(<const unsigned char *>PyBytes_AS_STRING(body), <size_t>PyBytes_GET_SIZE(body), &o, NULL) < 0:
        return None
    return [(o.m[i].ks, o.m[i].vs, o.m[i].ve) for i in range(o.n)]


cdef int _first(raw) except -1:
    """The first byte of a raw JSON value (msgspec.Raw: the decoder checked it, so no
    whitespace before it); 0 when it is empty (absent)."""
    cdef Py_buffer buf
    cdef int c = 0
    PyObject_GetBuffer(raw, &buf, PyBUF_SIMPLE)
    if buf.len:
        c = (<const unsigned char *>buf.buf)[0]
    if c == c'"' and buf.len >= 2 and (<const unsigned char *>buf.buf)[1] == c'"':
        c = 0  # the empty string: as absent
    PyBuffer_Release(&buf)
    return c


cdef str _json_kind(int c, raw):
    if c == c'{':
        return "object"
    if c == c't' or c == c'f':
        return "bool"
    return "float" if any(ch in bytes(raw) for ch in b".eE") else "int"


cdef _check_prompt(raw):
    """A completions prompt (raw): a non-empty string or list, as msgspec would have
    typed it (str | array | null)."""
    cdef int c = _first(raw)
    if c == c'"':
        return
    if c == c'[':
        if _nonempty_array(raw):
            return
        c = 0
    if c == 0 or c == c'n':
        raise BadRequest("`prompt` is required.", "prompt")
    raise BadRequest(f"Invalid request: Expected `str | array | null`, got `{_json_kind(c, raw)}` - at `$.prompt`",
                     "prompt")


cdef str _TOO_DEEP = ("The request body is nested too deeply: JSON arrays and objects nested past the "
                      "decoder's limit (about 1,000 levels) are refused.")


def too_deep():
    """The 400 for a body nested past the JSON decoder's recursion limit (msgspec raises
    RecursionError there, as Python's own decoders do)."""
    return BadRequest(_TOO_DEEP)


cdef _decode(decode, body):
    """``body`` decoded by ``decode`` (a decoder's bound method); BadRequest when it is
    empty, does not decode, or is nested past the decoder's depth (the except clauses
    cost nothing until one is taken)."""
    if not body:
        raise BadRequest("The request body is empty; a JSON object is expected.")
    try:
        return decode(body)
    except msgspec.DecodeError as e:
        raise _explain(e) from None
    except RecursionError:
        raise too_deep() from None


cdef bint _nonempty_array(raw) except -1:
    """The raw JSON value (msgspec.Raw, as the decoder checked it) is an array with at
    least one item: '[' then, past any whitespace, anything but ']'."""
    cdef Py_buffer buf
    cdef const unsigned char* v
    cdef Py_ssize_t i, n
    cdef bint ok = False
    PyObject_GetBuffer(raw, &buf, PyBUF_SIMPLE)
    v = <const unsigned char*>buf.buf
    n = buf.len
    if n >= 2 and v[0] == c'[':
        for i in range(1, n):
            if v[i] != c' ' and v[i] != c'\t' and v[i] != c'\n' and v[i] != c'\r':
                ok = v[i] != c']'
                break
    PyBuffer_Release(&buf)
    return ok


cpdef decode_proxy(bytes body, bint chat):
    """/v1/chat/completions (chat) or /v1/completions: a ProxyRequest, or BadRequest."""
    cdef PyObject* f[P_FIELDS]
    cdef bint compact
    return decode_fields(body, chat, f, &compact)


def decode_proxy_compact(bytes body, bint chat):
    """decode_proxy, and whether its messages and prompt are compact JSON text (True for
    a body the request scanner took)."""
    cdef PyObject* f[P_FIELDS]
    cdef bint compact
    r = decode_fields(body, chat, f, &compact)
    return r, compact


def decode_proxy_digests(bytes body, bint chat):
    """decode_proxy_compact, and the BlockDigests its scan made of the prompt (None when it
    made none): what the front door hands the router (for tests and benchmarks)."""
    cdef PyObject* f[P_FIELDS]
    cdef bint compact
    r = decode_fields(body, chat, f, &compact)
    return r, compact, take_digests(r)


cdef object decode_fields(bytes body, bint chat, PyObject** f, bint* compact):
    """decode_proxy for compiled callers: the fields it read are left in ``f[P_FIELDS]``
    (borrowed, alive while the returned ProxyRequest is), so they are read once; and
    ``compact[0]`` says whether messages and prompt (raw) are compact JSON text."""
    global _digests_of, _digests
    r = None
    compact[0] = False
    if PyBytes_GET_SIZE(body) >= _SCAN_MIN:
        r = _scanned(body)
        compact[0] = r is not None
    elif _digests_of is not None:
        _digests_of = _digests = None  # a request past, its body let go
    if r is None:
        r = _decode(_proxy_decode, body)
    proxy_fields(r, f)  # (a TypeError if the decoder made anything else)
    if chat:
        if not _nonempty_array(<object>f[P_MESSAGES]):
            raise BadRequest("`messages` is required and must be a non-empty list.", "messages")
    else:
        _check_prompt(<object>f[P_PROMPT])
    max_tokens = <object>f[P_MAX_TOKENS]
    if max_tokens is not None and not _tokens_ok(max_tokens):
        raise _tokens_error("max_tokens", max_tokens)
    max_completion_tokens = <object>f[P_MAX_COMPLETION_TOKENS]
    if max_completion_tokens is not None and not _tokens_ok(max_completion_tokens):
        raise _tokens_error("max_completion_tokens", max_completion_tokens)
    sla_ms = <object>f[P_SLA_MS]
    if sla_ms is not None and sla_ms is not _UNSET and sla_ms <= 0:
        raise BadRequest(f"`sla_ms` must be positive, got {sla_ms}.", "sla_ms")
    if <object>f[P_STREAM_OPTIONS] is not None and not <object>f[P_STREAM]:
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    return r


def decode_generate(body):
    """The native /generate route: a GenerateRequest, or BadRequest."""
    r = _decode(_generate_decode, body)
    if r.max_tokens < 1:
        raise BadRequest(f"`max_tokens` must be at least 1, got {r.max_tokens}.", "max_tokens")
    if r.sla_ms is not None and r.sla_ms <= 0:
        raise BadRequest(f"`sla_ms` must be positive, got {r.sla_ms}.", "sla_ms")
    return r


cpdef bytes strip_own_fields(bytes body, r):
    """The body to forward: byte for byte, unless it carries gateway fields."""
    global _cut_from, _cut
    if body is None:  # contains() reads the bytes' buffer
        raise TypeError("strip_own_fields() needs the body as bytes, not None")
    # contains (memmem), not `in`: on bytes `in` first tries its operand as an integer,
    # and so raises and clears a TypeError each time (about 1,800 instructions).
    if type(r) is ProxyRequest:  # it tells whether the body named them at all
        if proxy_field(r, P_PRIORITY) is _UNSET and proxy_field(r, P_SLA_MS) is _UNSET:
            return body
    elif (r.priority is None and r.sla_ms is None and not contains(body, b'"priority"')
            and not contains(body, b'"sla_ms"')):
        return body
    # Values stay raw bytes: a full decode/encode would turn a 20-digit seed into a float
    # and reformat numbers the engine may read differently. The scanner cuts the members
    # out by their spans; what it does not take is decoded into raw values and encoded.
    if body is _cut_from:  # the decoder cut it already
        out = _cut
        _cut_from = _cut = None
        return out
    cdef vr_object o
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(body)
    cdef size_t n = <size_t>PyBytes_GET_SIZE(body)
    cdef int rc
    if n >= _NOGIL_MIN:
        with nogil:
            rc = vr_scan(p, n, &o, NULL)
    else:
        rc = vr_scan(p, n, &o, NULL)
    if rc == 0:
        return _strip(p, &o) if o.own else body
    try:
        obj = _raw_object_decoder.decode(body)
    except RecursionError:  # (the body decoded once already, from a frame or two less deep)
        raise too_deep() from None
    removed = False
    for f in GATEWAY_FIELDS:
        if obj.pop(f, None) is not None:
            removed = True
    return msgspec.json.encode(obj) if removed else body


cdef bytes _ASK_USAGE = b'"stream_options":{"include_usage":true},'


cpdef bytes ask_usage(bytes body, bint has_options):
    """The body of a stream whose client did not ask for usage, asking the engine for it
    (``stream_options.include_usage``): the gateway settles token fairness and quotas from
    the stream's final usage chunk, and cuts that chunk from what the client gets.
    ``has_options``: the body names ``stream_options`` (without include_usage), which is
    then replaced by one that asks for usage alone (``continuous_usage_stats`` has no
    effect without include_usage, and with it would put usage on every chunk)."""
    cdef const char* p = PyBytes_AS_STRING(body)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body), i = 0
    cdef char* q
    if has_options:
        try:
            obj = _raw_object_decoder.decode(body)
        except RecursionError:
            raise too_deep() from None
        obj["stream_options"] = _Raw(b'{"include_usage":true}')
        return msgspec.json.encode(obj)
    # The member goes first, after the object's opening brace: one copy of the body, no
    # decoding (the decoder checked that it is an object with members, stream among them).
    while i < n and p[i] != c'{':
        i += 1
    if i == n:
        raise ValueError("ask_usage: the body is not a JSON object")
    out = PyBytes_FromStringAndSize(NULL, n + len(_ASK_USAGE))
    q = PyBytes_AS_STRING(out)
    memcpy(q, p, i + 1)
    memcpy(q + i + 1, PyBytes_AS_STRING(_ASK_USAGE), len(_ASK_USAGE))
    memcpy(q + i + 1 + len(_ASK_USAGE), p + i + 1, n - i - 1)
    return out
