"""Decoding client requests, compiled: decode_proxy and strip_own_fields run on every
proxied request (exchange.pyx's ``proxy`` calls them as C), decode_generate on /generate.

Only the fields the gateway needs are decoded; the body is forwarded as is unless it
carries the gateway's own fields. This is the one request decoder: the msgspec Structs
it decodes into are declared in gateway/request_types.py (a schema, no code), and its
errors are gateway/errors.py's BadRequest.
"""

cimport cython
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

from velocity_fast.lowlevel.fmt cimport contains
from velocity_fast.lowlevel.slots cimport slot, slot_offset

import msgspec

from velocity_fast.gateway.errors import BadRequest
from velocity_fast.gateway.request_types import GATEWAY_FIELDS, MAX_TOKENS_LIMIT, GenerateRequest, ProxyRequest

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
    return decode_fields(body, chat, f)


cdef object decode_fields(bytes body, bint chat, PyObject** f):
    """decode_proxy for compiled callers: the fields it read are left in ``f[P_FIELDS]``
    (borrowed, alive while the returned ProxyRequest is), so they are read once."""
    r = _decode(_proxy_decode, body)
    proxy_fields(r, f)  # (a TypeError if the decoder made anything else)
    if chat:
        if not _nonempty_array(<object>f[P_MESSAGES]):
            raise BadRequest("`messages` is required and must be a non-empty list.", "messages")
    else:
        prompt = <object>f[P_PROMPT]
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("`prompt` is required.", "prompt")
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
    # and reformat numbers the engine may read differently.
    try:
        obj = _raw_object_decoder.decode(body)
    except RecursionError:  # (the body decoded once already, from a frame or two less deep)
        raise too_deep() from None
    removed = False
    for f in GATEWAY_FIELDS:
        if obj.pop(f, None) is not None:
            removed = True
    return msgspec.json.encode(obj) if removed else body
