"""Run a service under uvloop until SIGTERM or SIGINT, then shut it down gracefully."""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

__all__ = ["run_until_signalled"]

Cleanup = Callable[[], Awaitable[None]]


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[Cleanup]]) -> int:
    """Run `main(stop)` on uvloop; it starts the service and returns its async cleanup.

    The cleanup runs after SIGTERM/SIGINT (or after `stop` is set by the service
    itself), so in-flight work can finish within the service's grace period.
    Returns the process exit code.
    """
    import uvloop

    async def amain() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        cleanup = await main(stop)
        try:
            await stop.wait()
        finally:
            await cleanup()
        return 0

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(amain())
