"""Micro benchmark: one enqueue + dispatch through the compiled bands vs the
pure-Python reference (bench/micro/reference_admission.py).

Run: .venv/bin/python -m pytest bench/micro/bench_bands.py --benchmark-only -q -p no:cacheprovider
Each round enqueues and dispatches N items over 8 tenants with a steady backlog of
64, so the figure per operation includes the tenant rotation; the summary printed
at the end divides by N. Target: <= 1 microsecond per enqueue + dispatch.
"""

import math

import pytest

from bench.micro.reference_admission import RefBands
from velocity_fast.admission.bands import BandQueues

N = 10_000
TENANTS = [f"t{i}" for i in range(8)]
BACKLOG = 64
RESULTS = {}


def _compiled():
    q = BandQueues([(0, 0, 0.0), (0, 0, 0.0), (0, 0, 0.0)])
    for i in range(BACKLOG):
        q.enqueue(None, TENANTS[i % 8], 1, 100, 10.0, math.inf, 0.0)
    enqueue, pop, inf = q.enqueue, q.pop, math.inf

    def run():
        for i in range(N):
            enqueue(None, TENANTS[i & 7], 1, 100, 10.0, inf, 0.0)
            pop(1, 0.0)

    return run


def _reference():
    q = RefBands()
    for i in range(BACKLOG):
        q.enqueue(None, TENANTS[i % 8], 100, 10.0, math.inf, 0.0)
    enqueue, pop, inf = q.enqueue, q.pop, math.inf

    def run():
        for i in range(N):
            enqueue(None, TENANTS[i & 7], 100, 10.0, inf, 0.0)
            pop()

    return run


@pytest.mark.parametrize("impl", ["compiled", "reference"])
def test_enqueue_dispatch(benchmark, impl):
    run = _compiled() if impl == "compiled" else _reference()
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    RESULTS[impl] = (benchmark.stats.stats.median / N * 1e9, benchmark.stats.stats.min / N * 1e9)


def teardown_module(_):
    if RESULTS:
        parts = [f"{k} {med:.0f} ns (min {low:.0f})" for k, (med, low) in sorted(RESULTS.items())]
        print("\nbands enqueue+dispatch per op (median): " + ", ".join(parts) + " (target <= 1000 ns compiled)")
