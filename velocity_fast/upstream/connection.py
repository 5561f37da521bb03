"""One keep-alive HTTP/1.1 connection to an engine, parsed with httptools.

The response is handed over as it arrives: the head through a future, body
pieces into a list that the relaying coroutine drains. Reading from the engine
pauses while the relay asks for it (the client reads slowly), so flow control
holds end to end.

A request sent with a listener (see UpstreamListener) is answered through plain
callbacks instead: no future, no task. A whole answer arrives at once in
``upstream_done``; a listener that sets ``relaying`` at the head gets a stream
piece by piece (``upstream_body``) and pauses reading itself (``pause``/``resume``).
A listener may also hand the connection back to the future path at the head by
clearing ``conn.listener``.
"""

from __future__ import annotations

from .errors import UpstreamError
from .._core.upstream import UpstreamConnection  # compiled: _core/upstream.pyx

__all__ = ["UpstreamConnection", "UpstreamError", "UpstreamListener"]


class UpstreamListener:
    """What a callback-driven request is told (UpstreamPool.request). Each runs once at most,
    in this order: head (status and headers known), then done (the whole body is in
    ``conn.chunks``) or error. ``abandoned`` True: the listener no longer wants an answer.
    A listener that sets ``relaying`` (in upstream_head) gets the body piece by piece in
    upstream_body instead, as it arrives, and done or error at its end. One that also sets
    ``raw_chunks`` gets a chunked body's whole chunks as they came, framing and all, in
    upstream_raw (to pass on to a chunked response unchanged), and the data of a chunk
    split across reads in upstream_body."""

    abandoned = False
    relaying = False
    raw_chunks = False

    def upstream_sent(self, conn: "UpstreamConnection") -> None:
        """The request went out on ``conn`` (to abort it on a cancel)."""

    def upstream_head(self, conn: "UpstreamConnection") -> None:
        """The response head arrived."""

    def upstream_body(self, conn: "UpstreamConnection", data: bytes) -> None:
        """A piece of the body (only while ``relaying``)."""

    def upstream_raw(self, conn: "UpstreamConnection", framed: bytes) -> None:
        """Whole chunks, framed (only while ``relaying`` and ``raw_chunks``)."""

    def upstream_done(self, conn: "UpstreamConnection") -> None:
        """The whole response arrived."""

    def upstream_error(self, conn: "UpstreamConnection | None", err: "UpstreamError") -> None:
        """The request failed (``err.received``: after the engine began answering)."""
