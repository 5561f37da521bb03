"""HTTP/1.1 server on asyncio Protocols and httptools.

The Protocol callbacks only parse, update state and schedule work (uvicorn's
httptools_impl is the model). Requests on one connection are answered in order:
pipelined requests wait in a queue; reading pauses when it grows too long.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from velocity_fast.http.message import Request
from velocity_fast.io import fdio
from velocity_fast.server.connection import HttpProtocol, Responder
from velocity_fast.server.limits import ServerLimits

__all__ = ["HTTPServer", "HttpProtocol", "Responder", "Handler"]

log = logging.getLogger("velocity.server")

# A handler answers through the Responder. It returns a coroutine (run as a task, the
# usual case) or None: then it has answered already, or arranged to answer from
# callbacks of its own (no task per request; it must watch for disconnects itself).
Handler = Callable[[Request, "Responder"], "Awaitable[None] | None"]

# After the grace, how long the endings given to cut responses (Responder.cut) may take
# to leave before their connections are aborted.
CUT_FLUSH_S = 1.0

# The connection and response objects are compiled (server/connection.pyx): what they do is
# described here and in docs/internals.md; the code is Python with C types.


class HTTPServer:
    """An HTTP/1.1 server for one handler; see docs/internals.md."""

    def __init__(
        self,
        handler: Handler,
        *,
        limits: ServerLimits | None = None,
        name: str = "http",
        on_error: Callable[[Request, Responder, str | None], None] | None = None,
    ) -> None:
        self.handler = handler
        # Called (within the except clause) when the handler raises or returns without an
        # answer, with what went wrong when no exception is in flight; it logs and answers.
        # None: the server logs the traceback and answers a bare 500.
        self.on_error = on_error
        self.limits = limits or ServerLimits()
        self.name = name
        self.errors = 0
        self._connections: set[HttpProtocol] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.base_events.Server | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._idle: asyncio.Future | None = None
        self._stopping: asyncio.Task | None = None
        self.port = 0
        self.host = ""
        # What a response still running at the end of the shutdown grace tells its client.
        self.cut_message = "The server shut down before the response was complete."
        self.cut = 0  # responses so ended by the last shutdown

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, sock=None, backlog: int = 2048, reuse_port: bool = False
    ) -> None:
        """Listen on host:port (port 0 picks a free one; see `port`) or on `sock`."""
        self.loop = asyncio.get_running_loop()
        if fdio.enabled():  # the gateway's own socket I/O (io/fdio.pyx)
            socks = [sock] if sock is not None else fdio.listen(host, port, backlog=backlog, reuse_port=reuse_port)
            self._server = fdio.Server(self.loop, lambda: HttpProtocol(self), socks, backlog)
        elif sock is not None:
            self._server = await self.loop.create_server(lambda: HttpProtocol(self), sock=sock, backlog=backlog)
        else:
            self._server = await self.loop.create_server(
                lambda: HttpProtocol(self), host, port, backlog=backlog, reuse_port=reuse_port or None
            )
        addr = self._server.sockets[0].getsockname()
        self.host, self.port = addr[0], addr[1]

    @property
    def connections(self) -> int:
        """Open client connections."""
        return len(self._connections)

    @property
    def in_flight(self) -> int:
        """Handlers running now."""
        return len(self._tasks)

    @property
    def requests(self) -> int:
        """Requests taken and not yet answered in full: one being answered on each busy
        connection, and those pipelined behind it (a handler without a task included)."""
        return sum(p.unanswered for p in self._connections)

    # -- what the connections tell it (server/connection.pyx) --------------------------------
    def connection_opened(self, proto: HttpProtocol) -> bool:
        """A connection was accepted; False when the server is shutting down (it is to
        close at once: accepted just before the listener closed)."""
        self._connections.add(proto)
        return self._idle is None

    def connection_closed(self, proto: HttpProtocol) -> None:
        self._connections.discard(proto)
        self._maybe_idle()

    def task_started(self, task: asyncio.Task) -> None:
        """A handler's task (handlers without one are not counted: see ``requests``)."""
        self._tasks.add(task)

    def task_ended(self, task: asyncio.Task | None) -> None:
        self._tasks.discard(task)
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self._idle is not None and not self._idle.done() and not self._connections and not self._tasks:
            self._idle.set_result(None)

    async def shutdown(self, grace: float = 10.0) -> None:
        """Stop accepting (the listening socket closes at once), let in-flight responses
        finish within `grace`, then end what still runs as Responder.cut does (a 503, or an
        event stream's error event and [DONE]) and close everything."""
        if self._server is None:
            return
        if self._stopping is None:
            self._stopping = self.loop.create_task(self._shutdown(grace))
        await asyncio.shield(self._stopping)

    async def _shutdown(self, grace: float) -> None:
        self._server.close()
        self._idle = self.loop.create_future()
        for proto in list(self._connections):
            proto.shutdown()
        self._maybe_idle()
        try:
            await asyncio.wait_for(asyncio.shield(self._idle), grace)
        except asyncio.TimeoutError:
            cut = 0
            for proto in list(self._connections):
                if proto.cut(self.cut_message):
                    cut += 1
            self.cut = cut
            if cut:
                log.warning(
                    "%s: shutdown grace of %g s over: %d response(s) still running ended with an error for the client",
                    self.name,
                    grace,
                    cut,
                )
                try:  # their endings leave, then the connections close
                    await asyncio.wait_for(asyncio.shield(self._idle), CUT_FLUSH_S)
                except asyncio.TimeoutError:
                    pass
            for proto in list(self._connections):
                proto.abort()  # what waits is dropped
            await asyncio.sleep(0)  # connection_lost runs: handlers see the disconnect
            # A handler that still runs would outlive its server: cancel it.
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
        await self._server.wait_closed()
        self._server = None
