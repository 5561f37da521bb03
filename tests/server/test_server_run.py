"""run_until_signalled (velocity_fast/server/run.py) in-process: the shapes `main` may
return, a service that ends itself, and errors that must not be swallowed."""

from __future__ import annotations

import asyncio
import signal
from contextlib import asynccontextmanager

import pytest

from velocity_fast.server.http_server import HTTPServer
from velocity_fast.server.run import run_until_signalled


async def _handler(req, resp):
    resp.send(200, b"{}")


def test_a_service_that_sets_stop_runs_its_cleanup_and_exits_0():
    log = []

    async def main(stop: asyncio.Event):
        log.append("started")
        asyncio.get_running_loop().call_later(0.01, stop.set)

        async def cleanup() -> None:
            log.append("cleaned")

        return cleanup

    assert run_until_signalled(main) == 0
    assert log == ["started", "cleaned"]


def test_servers_returned_by_main_are_shut_down():
    servers = []

    async def main():
        for _ in range(2):
            srv = HTTPServer(_handler)
            await srv.start("127.0.0.1", 0)
            servers.append(srv)
        # A signal the process sends itself, as an operator would.
        asyncio.get_running_loop().call_later(0.01, signal.raise_signal, signal.SIGTERM)
        return servers

    assert run_until_signalled(main, grace=1.0) == 0
    assert all(s._server is None for s in servers)


def test_an_async_context_manager_is_entered_and_exited():
    log = []

    @asynccontextmanager
    async def main(stop):
        log.append("enter")
        asyncio.get_running_loop().call_later(0.01, stop.set)
        try:
            yield
        finally:
            log.append("exit")

    assert run_until_signalled(main) == 0
    assert log == ["enter", "exit"]


def test_a_main_that_fails_to_start_raises_and_leaves_signals_as_they_were():
    before = signal.getsignal(signal.SIGTERM)

    async def main():
        raise RuntimeError("port in use")

    with pytest.raises(RuntimeError, match="port in use"):
        run_until_signalled(main)
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_unknown_return_value_is_a_clear_error():
    async def main():
        return 42

    with pytest.raises(TypeError, match="main returned 42"):
        run_until_signalled(main)


def test_a_signal_during_a_slow_start_cancels_the_start_and_exits_0():
    log = []

    async def main(stop):
        asyncio.get_running_loop().call_later(0.01, signal.raise_signal, signal.SIGTERM)
        try:
            await asyncio.sleep(60)  # an engine that takes minutes to load
        except asyncio.CancelledError:
            log.append("start cancelled")
            raise

        async def cleanup() -> None:
            log.append("cleanup")  # never: the service did not start

        return cleanup

    assert run_until_signalled(main) == 0
    assert log == ["start cancelled"]
