"""Bytes for many connections, gathered over one pass of the event loop and written at its end.

The outbox is compiled with the connections it serves: see the module doc of
velocity_fast/_core/server.pyx for why and how. An owner (``OutboxOwner``) keeps ``_out``
(None, or the pieces waiting), ``_out_bytes`` and ``_transport``; it calls ``flush_out``
ahead of ``close()`` and ``write_eof()``, and drops what waits on ``abort()``.
"""

from .._core.server import Outbox, OutboxOwner, flush_out, outbox_for

__all__ = ["Outbox", "OutboxOwner", "outbox_for", "flush_out"]
