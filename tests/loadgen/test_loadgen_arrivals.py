"""Arrival patterns have the documented shape, and the same seed gives the same times."""

import statistics

import pytest

from velocity_fast.loadgen.arrivals import PATTERNS, arrival_times

N, D = 2000, 10.0


def count_in(times, lo, hi):
    return sum(lo <= t < hi for t in times)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_monotone_count_and_seeded(pattern):
    t = arrival_times(pattern, N, D, seed=7)
    assert len(t) == N
    assert all(a <= b for a, b in zip(t, t[1:]))
    assert t[0] >= 0.0
    assert arrival_times(pattern, N, D, seed=7) == t


@pytest.mark.parametrize("pattern", ["poisson", "burst"])
def test_other_seed_other_times(pattern):
    assert arrival_times(pattern, N, D, seed=1) != arrival_times(pattern, N, D, seed=2)


def test_flood_all_at_zero():
    assert arrival_times("flood", 50, 0.0, seed=0) == [0.0] * 50


def test_constant_is_evenly_spaced():
    t = arrival_times("constant", 10, 5.0, seed=3)
    assert t == pytest.approx([i * 0.5 for i in range(10)])


def test_poisson_gaps_are_exponential_at_n_over_d():
    t = arrival_times("poisson", N, D, seed=11)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(D / N, rel=0.1)
    # The coefficient of variation of an exponential is 1 (constant gaps would give 0).
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.15)
    # Memorylessness, coarsely: about e^-1 of the gaps exceed the mean.
    assert sum(g > mean for g in gaps) / N == pytest.approx(0.368, abs=0.05)


def test_burst_counts_in_windows():
    t = arrival_times("burst", N, D, seed=5)
    assert all(0.0 <= x <= D for x in t)
    base_rate = 0.3 * N / D
    burst_rate = 0.7 * N / (0.2 * D)
    for lo, hi in ((0.4, 0.5), (0.8, 0.9)):
        got = count_in(t, lo * D, hi * D)
        # A window holds the burst rate over its length plus the base traffic there.
        assert got == pytest.approx((burst_rate + base_rate) * 0.1 * D, rel=0.1)
    quiet = count_in(t, 0.0, 0.4 * D) + count_in(t, 0.5 * D, 0.8 * D) + count_in(t, 0.9 * D, D)
    assert quiet == pytest.approx(base_rate * 0.8 * D, rel=0.1)
    # Bursts are much denser than the base: the whole point of the pattern.
    assert count_in(t, 0.4 * D, 0.5 * D) > 5 * count_in(t, 0.1 * D, 0.2 * D)


def test_bad_input():
    with pytest.raises(ValueError):
        arrival_times("zigzag", 10, 1.0, seed=0)
    with pytest.raises(ValueError):
        arrival_times("poisson", 10, 0.0, seed=0)
