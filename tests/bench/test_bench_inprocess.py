"""bench/inprocess.py drives the real request path on fake transports: 64 clients in a
closed loop at the default max-concurrency of 32, so half of them wait in admission.
Every request must come back 200 (the harness raises on anything else or a stall)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest

from tests.support.bench import bench_module
from tests.support.otlp import need_otel

pytestmark = pytest.mark.timeout(60)


def _harness():
    return bench_module("inprocess")


async def test_every_request_of_64_clients_is_answered_through_the_queue():
    us, rps = await _harness().drive(3000, 64)
    assert us > 0 and rps > 0


async def test_every_streamed_answer_reaches_its_client_whole():
    # Each of 64 engine connections sends 8 events, one per read, then [DONE] and the last
    # chunk; the harness counts an answer once its client holds the chunked stream's end.
    us, rps = await _harness().drive(600, 64, stream_events=8)
    assert us > 0 and rps > 0


@pytest.mark.parametrize("stream_events", [0, 4])
async def test_a_finished_request_leaves_no_reference_cycle_behind(stream_events):
    # Objects of a finished request must be freed by their reference counts: any left in
    # a cycle wait for the collector, whose passes then walk every object of every
    # request in flight (measured: a sixth of the gateway's CPU under load).
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await _harness().drive(400, 64, stream_events=stream_events)
        gc.collect()
        left = Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    per_request = {"Request", "Responder", "Exchange", "Ticket", "Lease", "Item", "ProxyRequest"}
    assert not {k: v for k, v in left.items() if k in per_request}, left.most_common(12)


async def test_every_traced_request_is_answered_and_its_spans_exported():
    """--trace-ratio 1: every request traced, its spans posted to the stand-in collector
    before the figure is taken (drive waits for the export)."""
    need_otel()
    h = _harness()
    sink, url = h.otlp_sink()
    try:
        us, rps = await h.drive(300, 16, trace_url=url, trace_ratio=1.0)
    finally:
        h.stop_sink(sink)
    assert us > 0 and rps > 0
