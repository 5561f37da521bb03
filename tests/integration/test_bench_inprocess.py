"""bench/inprocess.py drives the real request path on fake transports: 64 clients in a
closed loop at the default max-concurrency of 32, so half of them wait in admission.
Every request must come back 200 (the harness raises on anything else or a stall)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

_PATH = Path(__file__).resolve().parents[2] / "bench" / "inprocess.py"


def _harness():
    spec = importlib.util.spec_from_file_location("bench_inprocess", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_every_request_of_64_clients_is_answered_through_the_queue():
    us, rps = await _harness().drive(3000, 64)
    assert us > 0 and rps > 0


async def test_every_streamed_answer_reaches_its_client_whole():
    # Each of 64 engine connections sends 8 events, one per read, then [DONE] and the last
    # chunk; the harness counts an answer once its client holds the chunked stream's end.
    us, rps = await _harness().drive(600, 64, stream_events=8)
    assert us > 0 and rps > 0
