"""Shared test setup: every asyncio test runs on uvloop (what we ship) and fails
if its loop saw an unhandled exception (a task that died unobserved, a callback
that raised)."""

from __future__ import annotations

import pytest
import uvloop

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


# The Makefile's `test` runs three passes. First everything unmarked, four at a time
# (pytest-xdist; the pass keeps about 1.2 of the 2 cores busy). Then the `timed` tests,
# three at a time: a test is `timed` when its verdict is a figure measured against the
# clock (a latency or its ratio, a throughput, an SLA met, a rate over a window). Each
# uses only 0.1-0.6 of a core, its time going to sim engines that sleep through their
# simulated work, so three fit beside each other, and beside a CPU-bound process too once
# each verdict waits for the state it measures (a store that answered throughout, learned
# limits) and takes the better of its runs where noise only ever makes a run worse. Last
# the `serial` tests, alone: they load both cores (wrk, valgrind, a benchmark pinned to
# cores). Mark a test with one of the two and say why.
# End-to-end tests that check statuses, counts, routes and output run in the first pass.
