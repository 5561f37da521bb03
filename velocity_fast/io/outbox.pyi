"""Stubs for velocity_fast.io.outbox (the writes of one loop pass, gathered and sent together)."""

import asyncio
from typing import Any

from velocity_fast.io.fdio import Protocol

class OutboxOwner(Protocol):
    """What the outbox writes for: a connection with a transport."""

    _out: bytes | list[bytes] | None
    _out_bytes: int
    _transport: Any

class Outbox:
    """The owners with bytes waiting in this loop pass; flushed from the loop's ready queue."""
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def write(self, owner: OutboxOwner, data: bytes) -> None:
        """Queue ``data`` for ``owner``'s transport; it leaves at the end of this loop pass."""

def flush_out(owner: OutboxOwner) -> None:
    """Write what waits for ``owner`` now."""

def outbox_for(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The loop's outbox (one per loop, shared by every server and engine connection on it)."""
