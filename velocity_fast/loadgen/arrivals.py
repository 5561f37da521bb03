"""Arrival times for the four load patterns (seconds from the start of a run).

The shapes are fixed (docs/design.md, "Where each contract lives") so that every run and every policy
sees comparable traffic:

- ``flood``: every request at t=0.
- ``constant``: request i at ``i * D / N``.
- ``poisson``: exponential gaps at rate ``N / D`` (the last arrival lands near D,
  not exactly on it).
- ``burst``: a base rate of ``0.3 N / D`` over the whole run plus bursts of rate
  ``0.7 N / (0.2 D)`` inside ``[0.4 D, 0.5 D]`` and ``[0.8 D, 0.9 D]``. Counts are
  fixed (``round(0.3 N)`` base, the rest split over the two bursts) and the times
  inside each part are uniform order statistics, i.e. a Poisson process
  conditioned on its count, so a window holds the documented number exactly.
"""

from __future__ import annotations

import random

PATTERNS = ("flood", "constant", "poisson", "burst")

# Where the bursts sit, as fractions of the run; the base share of the traffic.
BURST_WINDOWS = ((0.4, 0.5), (0.8, 0.9))
BURST_BASE_SHARE = 0.3


def arrival_times(pattern: str, n: int, duration: float, seed: int) -> list[float]:
    """Return ``n`` non-decreasing arrival offsets for ``pattern`` over ``duration`` s.

    The same ``(pattern, n, duration, seed)`` always gives the same list.
    """
    if n < 0:
        raise ValueError("number of requests must be >= 0")
    if pattern != "flood" and duration <= 0 and n > 0:
        raise ValueError(f"pattern {pattern!r} needs a duration > 0")
    rng = random.Random(f"arrivals:{seed}")
    if pattern == "flood":
        return [0.0] * n
    if pattern == "constant":
        return [i * duration / n for i in range(n)]
    if pattern == "poisson":
        rate = n / duration
        t = 0.0
        out = []
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    if pattern == "burst":
        return _burst(n, duration, rng)
    raise ValueError(f"unknown pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")


def _burst(n: int, duration: float, rng: random.Random) -> list[float]:
    base = round(BURST_BASE_SHARE * n)
    in_bursts = n - base
    times = [rng.uniform(0.0, duration) for _ in range(base)]
    first = in_bursts // 2 + in_bursts % 2
    for (lo, hi), count in zip(BURST_WINDOWS, (first, in_bursts - first)):
        times.extend(rng.uniform(lo * duration, hi * duration) for _ in range(count))
    times.sort()
    return times
