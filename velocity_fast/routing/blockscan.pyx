"""Prefix block hashes straight from a request's JSON bytes, compiled.

The router's prefix affinity hashes a rendering of the prompt (routing/prefix_render.py).
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


cdef int _render(object data, int what, size_t block, uint64_t seed, vb_result *res) except -2:
    """vb_render over data's bytes (bytes, msgspec.Raw or any buffer): 0, or -1 when not taken."""
    cdef Py_buffer view
    cdef const unsigned char *p
    cdef size_t n
    cdef int rc
    if type(data) is bytes:
        p = <const unsigned char *>PyBytes_AS_STRING(data)
        n = <size_t>PyBytes_GET_SIZE(data)
        with nogil:
            rc = vb_render(p, n, what, block, seed, res)
        return rc
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            rc = vb_render(<const unsigned char *>view.buf, <size_t>view.len, what, block, seed, res)
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
    out._h = res.hashes  # (BlockHashes frees it)
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


def render_body(body):
    """The rendering hash_body hashes (render_prompt's bytes), or None where it gives None."""
    return _text(body, VB_BODY)


def render_messages(messages):
    """The rendering hash_messages hashes, or None where it gives None."""
    return _text(messages, VB_MESSAGES)
