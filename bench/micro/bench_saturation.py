"""Micro benchmark: one saturation update (record a scrape, recompute the endpoint)
through the compiled core vs the pure-Python reference.

Run: .venv/bin/python -m pytest bench/micro/bench_saturation.py --benchmark-only -q -p no:cacheprovider
Target: <= 1 microsecond per update. Also times one pool number over 4 endpoints.
"""

import pytest

from bench.micro.reference_admission import RefLoad, ref_update
from velocity_fast.admission.saturation import EndpointLoad, Saturation

N = 10_000
RESULTS = {}


def _compiled():
    s = Saturation()
    e = EndpointLoad(32)
    e.inflight = 40
    update = s.update

    def run():
        for i in range(N):
            update(e, 24.0, 3.0, 0.5, 100.0, 100.05)

    return run


def _reference():
    e = RefLoad(32)
    e.inflight = 40

    def run():
        for i in range(N):
            ref_update(e, 24.0, 3.0, 0.5, 100.0, 100.05)

    return run


def _pool():
    s = Saturation()
    loads = [EndpointLoad(32) for _ in range(4)]
    for i, e in enumerate(loads):
        e.inflight = 10 * i
        s.update(e, 8.0 * i, float(i), 0.2 * i, 100.0, 100.0)
    pool = s.pool

    def run():
        for i in range(N):
            pool(loads, 3.0, 100.05)

    return run


@pytest.mark.parametrize("impl", ["compiled", "reference", "compiled-pool4"])
def test_saturation_update(benchmark, impl):
    run = {"compiled": _compiled, "reference": _reference, "compiled-pool4": _pool}[impl]()
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    RESULTS[impl] = (benchmark.stats.stats.median / N * 1e9, benchmark.stats.stats.min / N * 1e9)


def teardown_module(_):
    if RESULTS:
        parts = [f"{k} {med:.0f} ns (min {low:.0f})" for k, (med, low) in sorted(RESULTS.items())]
        print("\nsaturation update per op (median): " + ", ".join(parts) + " (target <= 1000 ns compiled)")
