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

An owner is any object with the attributes ``_out`` (None, or the list of waiting
pieces), ``_out_bytes`` (what waits, in bytes: an owner that streams flushes at once
past its transport's high-water mark, so flow control still holds a producer back)
and ``_transport``, and the method ``_flush_out`` (see ``flush_out``).
"""

from __future__ import annotations

import asyncio
import weakref

__all__ = ["Outbox", "outbox_for", "flush_out"]


class Outbox:
    """The owners with bytes waiting in this loop pass; flushed from the loop's ready queue."""

    __slots__ = ("_loop", "_owners", "_scheduled", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._owners: list = []
        self._scheduled = False

    def write(self, owner, data: bytes) -> None:
        """Queue ``data`` for ``owner``'s transport; it leaves at the end of this loop pass."""
        out = owner._out
        if out is not None:
            out.append(data)
            return
        owner._out = [data]
        self._owners.append(owner)
        if not self._scheduled:
            self._scheduled = True
            # From an I/O callback this runs in the loop's next ready-queue pass:
            # after every read of this pass, before the next poll for events.
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        owners, self._owners = self._owners, []
        for owner in owners:
            owner._flush_out()


def flush_out(owner) -> None:
    """Write what waits for ``owner`` now (the body of an owner's ``_flush_out``)."""
    out = owner._out
    if out is None:
        return
    owner._out = None
    owner._out_bytes = 0
    t = owner._transport
    if t is None or t.is_closing():
        return  # the peer is gone (or the stream aborted): nothing can be delivered
    if len(out) == 1:
        t.write(out[0])
    else:
        t.writelines(out)  # one system call for the pass


_outboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox]" = weakref.WeakKeyDictionary()


def outbox_for(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The loop's outbox (one per loop, shared by every server and engine connection on it)."""
    box = _outboxes.get(loop)
    if box is None:
        box = _outboxes[loop] = Outbox(loop)
    return box
