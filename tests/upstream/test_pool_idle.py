"""The engine pool's idle connections (upstream/pool.pyx): the most recent is reused
first, a closed one is passed over, a forgotten one is gone, and ``stats()["idle"]``
(what /stats shows of each engine's pool) counts what is really there, however the
connections came and went."""

from __future__ import annotations

import asyncio

import pytest

from velocity_fast.upstream.connection import UpstreamConnection
from velocity_fast.upstream.pool import UpstreamPool

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_idle_connections_come_back_most_recent_first_and_counted(loop):
    pool = UpstreamPool("http://127.0.0.1:9")
    a, b, c = (UpstreamConnection(pool, loop) for _ in range(3))
    for conn in (a, b, c):
        pool.adopt(conn)
    assert pool.stats()["idle"] == 3
    assert pool.idle_connection() is c
    pool.forget(a)  # closed by the engine while idle
    assert pool.stats()["idle"] == 1
    assert pool.idle_connection() is b
    assert pool.idle_connection() is None
    assert pool.stats()["idle"] == 0

    # Again after the list emptied: its slots are reused, nothing stale comes back.
    d, e = UpstreamConnection(pool, loop), UpstreamConnection(pool, loop)
    pool.adopt(d)
    pool.adopt(e)
    e.closed = True
    assert pool.stats()["idle"] == 2
    assert pool.idle_connection() is d  # the closed one passed over, and dropped
    assert pool.idle_connection() is None
    assert pool.stats()["idle"] == 0


def test_forgetting_a_connection_that_is_not_idle_leaves_the_idle_ones(loop):
    pool = UpstreamPool("http://127.0.0.1:9")
    a, busy = UpstreamConnection(pool, loop), UpstreamConnection(pool, loop)
    pool.adopt(a)
    pool.forget(busy)
    assert pool.stats()["idle"] == 1
    assert pool.idle_connection() is a
