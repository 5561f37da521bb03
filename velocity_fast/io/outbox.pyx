"""Bytes for many connections, gathered over one pass of the event loop and written at its end.

uvloop writes at once: each ``transport.write`` is a system call, and on a socket whose
reader sleeps in epoll it is also that reader's wake-up, which the writer pays for (on
a virtual machine an inter-processor interrupt: measured as the largest kernel cost of
a proxied request). A pass that has read a hundred requests would wake the engine and
the clients a hundred times each. Gathered here, the writes of one pass leave together
after every read of that pass was handled: a peer woken by the first of them is still
running when the next ones land, and the writes of one connection in one pass leave in
one system call (``writelines``).

Only bytes wait; every state change stays where it happens. An owner's bytes leave in
the order they were given, and before anything that ends its stream: owners call
``flush_out`` ahead of ``close()`` and ``write_eof()``, and drop what waits on ``abort()``.
An owner is an ``OutboxOwner``: ``_out`` (None, the one waiting piece, or a list of them),
``_out_bytes`` (what waits, in bytes) and ``_transport``.
"""

import weakref

from velocity_fast.io.fdio cimport FdTransport

__all__ = ["Outbox", "OutboxOwner", "flush_out", "outbox_for"]


cdef class OutboxOwner:
    """What the outbox writes for: a connection with a transport (see the module doc)."""

    def __cinit__(self):
        self._out = None
        self._out_bytes = 0
        self._transport = None


cdef class Outbox:
    """The owners with bytes waiting in this loop pass; flushed from the loop's ready queue."""

    def __init__(self, loop):
        self._loop = loop
        self._owners = []
        self._scheduled = False

    cpdef write(self, OutboxOwner owner, bytes data):
        """Queue ``data`` for ``owner``'s transport; it leaves at the end of this loop pass."""
        out = owner._out
        if out is not None:
            if type(out) is list:
                (<list>out).append(data)
            else:  # a second piece in this pass (the first is kept alone: no list)
                owner._out = [out, data]
            return
        owner._out = data
        self._owners.append(owner)
        if not self._scheduled:
            self._scheduled = True
            # From an I/O callback this runs in the loop's next ready-queue pass:
            # after every read of this pass, before the next poll for events.
            self._loop.call_soon(self._flush)

    def _flush(self):
        cdef OutboxOwner owner
        self._scheduled = False
        owners, self._owners = self._owners, []
        for owner in owners:
            flush_out(owner)


cpdef flush_out(OutboxOwner owner):
    """Write what waits for ``owner`` now."""
    out = owner._out
    if out is None:
        return
    owner._out = None
    owner._out_bytes = 0
    t = owner._transport
    if t is None:
        return
    if type(t) is FdTransport:  # the gateway's own I/O: C calls
        if (<FdTransport>t).closing:
            return
        if type(out) is bytes:
            (<FdTransport>t).write_bytes(<bytes>out)
        else:
            (<FdTransport>t).write_list(<list>out)
        return
    if owner._t_for is not t:
        # Its write and is_closing kept bound, for this transport: a bound method skips
        # the method look-up that each call by name would make.
        owner._t_write, owner._t_is_closing, owner._t_for = t.write, t.is_closing, t
    if owner._t_is_closing():
        return  # the peer is gone (or the stream aborted): nothing can be delivered
    if type(out) is bytes:
        owner._t_write(out)
    else:
        t.writelines(out)  # one system call for the pass


# By the loop's id, weakly (its connections hold the outbox): an outbox holds its loop,
# and a map by loop would keep every loop the process ever ran.
_outboxes = weakref.WeakValueDictionary()


cpdef Outbox outbox_for(loop):
    """The loop's outbox (one per loop, shared by every server and engine connection on it)."""
    box = _outboxes.get(id(loop))
    if box is None or (<Outbox>box)._loop is not loop:
        box = Outbox(loop)
        _outboxes[id(loop)] = box
    return box
