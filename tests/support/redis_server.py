"""A real ``redis-server`` on a free 127.0.0.1 port for a test, stopped for sure.

    with redis_server() as rs:
        rs.url                 # redis://127.0.0.1:PORT/0
        rs.pause(); rs.resume()  # SIGSTOP / SIGCONT: a store that does not answer
        rs.stop(); rs.start()    # gone, then back on the same port (empty: no persistence)

Debian's ``redis-server`` package (.ci/run installs it) and the ``redis`` Python package.
Without them the test skips, saying so, except under CI (``CI`` set), where it fails: CI
must run these tests.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from typing import Iterator

import pytest

from velocity_fast.harness import redis as harness_redis

__all__ = ["RedisServer", "redis_server", "redis_binary"]


def redis_binary() -> str:
    """The redis-server binary, or skip (fail under CI); the gateway's side needs the
    `redis` package (the `test` extra has it) as well."""
    path = harness_redis.redis_binary()
    msg = None
    if path is None:
        msg = "redis-server is not installed (apt-get install redis-server)"
    elif importlib.util.find_spec("redis") is None:
        msg = "the redis package is not installed (pip install -e '.[test]')"
    if msg:
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


class RedisServer(harness_redis.RedisServer):
    """The harness's redis-server (killed with the test process, even paused) on a free port."""

    def __init__(self) -> None:
        super().__init__(redis_binary())


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    rs = RedisServer()
    try:
        rs.start()
        yield rs
    finally:
        rs.close()
