"""Prefix block hashes straight from a request's JSON bytes, compiled.

Approximate prefix affinity hashes the prompt's JSON text as the client wrote it
(hash_json: no decoding, the hash's own speed). The rest of this module renders the
prompt as text, for precise routing, which tokenizes it.

The rendering is routing/prefix_render.py's.
Rendering in Python means decoding the body's messages into Python objects first. Here
the same rendering is made by a C scanner over the raw bytes
(csrc/blockscan.h) and its full blocks hashed as they come, with PrefixHasher's chain:
the result is the BlockHashes that ``hasher.hash(render_prompt(body), model)`` gives,
without one Python object per message.

Whatever the scanner does not take (malformed JSON, nesting past 64 levels, a float
where the rendering would hold canonical JSON) gives None: the caller then renders in
Python as before. It never raises for the bytes it is given.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from libc.stdlib cimport free

from velocity_fast.routing.prefix cimport BlockHashes, PrefixHasher


cdef extern from "blockscan.h":
    int VB_BODY
    int VB_MESSAGES

    ctypedef struct vb_result:
        uint64_t *hashes
        size_t n
        unsigned char *text
        size_t len

    int vb_render(const unsigned char *data, size_t length, int what, size_t block, uint64_t seed,
                  vb_result *res) nogil
    int vb_hash_json(const unsigned char *data, size_t length, int compact, size_t block, uint64_t seed,
                     vb_result *res) nogil


cdef enum:
    _JSON = -1  # vb_hash_json, not vb_render
    _JSON_COMPACT = -2  # vb_hash_json of text without whitespace between tokens


cdef inline int _call(const unsigned char *p, size_t n, int what, size_t block, uint64_t seed,
                      vb_result *res) noexcept nogil:
    if what == _JSON or what == _JSON_COMPACT:
        return vb_hash_json(p, n, what == _JSON_COMPACT, block, seed, res)
    return vb_render(p, n, what, block, seed, res)


# The GIL is let go for a pass over at least this many bytes: below it, letting go and
# taking it back (two locks and a signal) costs more than another thread could gain.
cdef size_t _NOGIL_MIN = 65536


cdef int _render(object data, int what, size_t block, uint64_t seed, vb_result *res) except -2:
    """vb_render (or vb_hash_json) over data's bytes (bytes, msgspec.Raw or any buffer):
    0, or -1 when not taken."""
    cdef Py_buffer view
    cdef const unsigned char *p
    cdef size_t n
    cdef int rc
    if type(data) is bytes:
        p = <const unsigned char *>PyBytes_AS_STRING(data)
        n = <size_t>PyBytes_GET_SIZE(data)
        if n >= _NOGIL_MIN:
            with nogil:
                rc = _call(p, n, what, block, seed, res)
        else:
            rc = _call(p, n, what, block, seed, res)
        return rc
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if <size_t>view.len >= _NOGIL_MIN:
            with nogil:
                rc = _call(<const unsigned char *>view.buf, <size_t>view.len, what, block, seed, res)
        else:
            rc = _call(<const unsigned char *>view.buf, <size_t>view.len, what, block, seed, res)
    finally:
        PyBuffer_Release(&view)
    return rc


cdef BlockHashes _hashes(object data, int what, PrefixHasher hasher, str model):
    cdef vb_result res
    cdef uint64_t seed = hasher.seed_for(model)
    cdef BlockHashes out
    if _render(data, what, <size_t>hasher.block_bytes, seed, &res) < 0:
        return None
    out = BlockHashes.__new__(BlockHashes)
    out.keys = res.hashes  # (BlockHashes frees it)
    out.n = <Py_ssize_t>res.n
    out.seed = seed
    out.block_bytes = hasher.block_bytes
    return out


cdef object _text(object data, int what):
    cdef vb_result res
    if _render(data, what, 0, 0, &res) < 0:
        return None
    try:
        return PyBytes_FromStringAndSize(<char *>res.text, <Py_ssize_t>res.len) if res.len else b""
    finally:
        free(res.text)


cpdef BlockHashes hash_body(object body, PrefixHasher hasher, str model):
    """The prompt block hashes of a request body (bytes of a JSON object), as
    ``hasher.hash(render_prompt(decoded body), model)`` gives them; None when the scanner
    does not take the body (the caller then renders it in Python)."""
    return _hashes(body, VB_BODY, hasher, model)


cpdef BlockHashes hash_messages(object messages, PrefixHasher hasher, str model):
    """The prompt block hashes of a chat request from its raw ``messages`` value (the
    msgspec.Raw that the request decoder keeps, or bytes); None when it is not a
    non-empty array (the prompt would decide) or the scanner does not take it."""
    return _hashes(messages, VB_MESSAGES, hasher, model)


cpdef BlockHashes hash_json(object value, PrefixHasher hasher, str model, bint compact=False):
    """The prompt block hashes of one JSON value as the client wrote it (a chat request's
    raw ``messages``, a completions ``prompt``): its text without the whitespace between
    tokens and without its last byte, cut into blocks (csrc/blockscan.h, vb_hash_json).
    ``value`` (bytes, msgspec.Raw or any buffer) must be valid JSON, as the request
    decoder leaves it. ``compact``: the caller knows there is no whitespace between its
    tokens (the decoder said so), so it is hashed without a walk. prefix_render.json_text
    is the same text in Python."""
    cdef BlockHashes out = _hashes(value, _JSON_COMPACT if compact else _JSON, hasher, model)
    if out is None:
        raise MemoryError()
    return out


def render_body(body):
    """The rendering hash_body hashes (render_prompt's bytes), or None where it gives None."""
    return _text(body, VB_BODY)


def render_messages(messages):
    """The rendering hash_messages hashes, or None where it gives None."""
    return _text(messages, VB_MESSAGES)
