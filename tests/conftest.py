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


# Tests that measure time against time, or run whole benchmarks, run alone after the rest
# (the Makefile's second pass): on 2 cores another test beside them is noise in their
# figures. The rest run two at a time (pytest-xdist); see Makefile's `test`.
SERIAL_DIRS = ("e2e", "bench")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.relative_to(Path(__file__).parent).parts
        if parts[0] in SERIAL_DIRS or item.get_closest_marker("e2e") or item.get_closest_marker("bench"):
            item.add_marker(pytest.mark.serial)
