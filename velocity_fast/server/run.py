"""Run a service under uvloop until SIGTERM or SIGINT, then shut it down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
from typing import Any, Awaitable, Callable

__all__ = ["run_until_signalled"]

Cleanup = Callable[[], Awaitable[None]]


def run_until_signalled(main: Callable[..., Any], *, grace: float = 10.0) -> int:
    """Run `main` on uvloop until SIGTERM/SIGINT, then shut the service down; returns 0.

    `main` is a coroutine function, called as `main(stop)` when it takes an
    argument (`stop` is an asyncio.Event the service may set to end itself) or as
    `main()`. What it returns says how to shut the service down:

    - an async callable: the cleanup, awaited as is;
    - an HTTPServer, or a list of them: `shutdown(grace)` on each, together;
    - an async context manager (also when `main` itself is one, e.g. made with
      contextlib.asynccontextmanager): entered now, exited on the signal.

    In-flight work can thus finish within the grace period before the loop closes.
    Freed request bodies stay in the process heap (``heap.keep_freed_memory``).
    """
    import uvloop

    from .heap import keep_freed_memory

    keep_freed_memory()

    async def amain() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            started = main(stop) if _takes_an_argument(main) else main()
            if inspect.isawaitable(started):
                starting = asyncio.ensure_future(started)
                signalled = asyncio.ensure_future(stop.wait())
                await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
                signalled.cancel()
                if not starting.done():
                    starting.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await starting
                    return 0
                started = starting.result()
            if hasattr(started, "__aenter__"):
                async with started:
                    await stop.wait()
                return 0
            cleanup = _cleanup_for(started, grace)
            try:
                await stop.wait()
            finally:
                await cleanup()
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(amain())


def _takes_an_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _cleanup_for(started: Any, grace: float) -> Cleanup:
    if started is None:

        async def nothing() -> None:
            return None

        return nothing
    if hasattr(started, "shutdown"):
        started = [started]
    if isinstance(started, (list, tuple)):
        servers = list(started)

        async def shut_all() -> None:
            await asyncio.gather(*(s.shutdown(grace) for s in servers))

        return shut_all
    if callable(started):
        return started
    raise TypeError(
        f"run_until_signalled: main returned {started!r}; expected a cleanup coroutine "
        "function, a server or a list of servers, or an async context manager"
    )
