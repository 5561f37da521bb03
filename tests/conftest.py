"""Shared test setup: every asyncio test runs on uvloop (what we ship) and fails
if its loop saw an unhandled exception (a task that died unobserved, a callback
that raised)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Fixtures every test may use without importing them (fake GPUs and vllm on PATH).
pytest_plugins = ["tests.support.fakes"]

_loop_errors: list[dict] = []


def _record(loop, context) -> None:
    _loop_errors.append(context)
    loop.default_exception_handler(context)


def _new_checked_loop():
    loop = uvloop.new_event_loop()
    loop.set_exception_handler(_record)
    return loop


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": _new_checked_loop}


@pytest.fixture(autouse=True)
def _fail_on_loop_errors():
    _loop_errors.clear()
    yield
    if _loop_errors:
        msgs = [str(c.get("exception") or c.get("message")) for c in _loop_errors]
        _loop_errors.clear()
        pytest.fail(f"unhandled exceptions in the event loop: {msgs}")


# The Makefile's `test` runs two passes: everything not marked `serial` two at a time
# (pytest-xdist), then the `serial` tests one at a time. A test is `serial` when its verdict
# is a figure measured against the clock (a latency or its ratio, a throughput, an SLA
# met, a rate over a window) or when it loads both cores (a flood, wrk, valgrind, a
# benchmark pinned to cores): a test beside it on 2 cores would be noise in its figures,
# or would slow the other past its timeouts. Mark it with `pytest.mark.serial` and say
# which of the two it is. End-to-end tests that check statuses, counts, routes and output
# run in the first pass like the rest.
