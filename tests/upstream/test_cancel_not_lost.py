"""A stop must stop: cancels that land as a piece of work completes are not dropped.

On Python 3.11 ``asyncio.wait_for`` returns the inner result when the outer task is
cancelled just as the inner work finishes, and the cancel is lost: an endpoint monitor
told to stop then slept on, and ``Gateway.stop`` waited for it forever (seen as a rare
hang of the admission e2e burst test).
"""

from __future__ import annotations

import asyncio

import pytest

from velocity_fast.fleet.endpoint import Endpoint
from velocity_fast.fleet.health import EndpointMonitor, HealthSettings
from velocity_fast.upstream.connection import UpstreamConnection
from velocity_fast.upstream.pool import UpstreamPool


def _done_conn(pool: UpstreamPool) -> UpstreamConnection:
    """A connection whose whole answer is already in."""
    conn = UpstreamConnection(pool, asyncio.get_running_loop())
    conn.status, conn.done, conn.chunks = 200, True, [b"ok"]
    return conn


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
async def test_a_fetch_cancelled_as_its_answer_lands_raises_cancelled(steps):
    class _AnsweredPool(UpstreamPool):
        async def open_request(self, data: bytes):
            return _done_conn(self)

    pool = _AnsweredPool("http://127.0.0.1:9")
    task = asyncio.create_task(pool.fetch("GET", "/health"))
    for _ in range(steps):
        await asyncio.sleep(0)
    was_done = task.done()
    task.cancel()
    if was_done:
        assert task.result() == (200, b"ok")
    else:
        # Not finished when cancelled: the caller asked it to stop, so it must not return.
        with pytest.raises(asyncio.CancelledError):
            await task
    pool.close()


async def test_monitor_stop_ends_a_watch_that_swallowed_a_cancel():
    swallowed = asyncio.Event()

    async def check(ep) -> bool:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # as a library call that finished its work as the cancel landed
        return True

    mon = EndpointMonitor(HealthSettings(), lambda ep, state: None, lambda ep: None)
    mon._check = check
    ep = Endpoint("e1", "http://127.0.0.1:9", "m")
    ep.upstream = UpstreamPool(ep.url)
    mon.watch(ep)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(mon.stop(), 5.0)  # before: waited for the monitor forever
    assert swallowed.is_set()
    ep.upstream.close()
