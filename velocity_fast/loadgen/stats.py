"""The metrics of a run: throughput, goodput, latency percentiles, TTFT, ITL, rejections.

Definitions (also in bench/README.md):
- latency: from the moment the request was written to the last byte of the response;
- completed: HTTP 200 with a complete body and no error event in the stream;
- goodput: completed requests whose latency is within their SLA (the band's
  ``sla_ms`` or ``--sla-ms``), per second of the run and as a share of all requests;
- the run lasts from its start to the last response;
- percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 95, 99)


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of already sorted values; NaN when empty."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError("percentile must be within [0, 100]")
    rank = p / 100.0 * (n - 1)
    lo = int(rank)
    hi = min(lo + 1, n - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def distribution(values: Iterable[float], scale: float = 1.0) -> dict:
    """Count, mean, max and the standard percentiles of ``values`` times ``scale``."""
    v = sorted(x * scale for x in values)
    out = {"count": len(v), "mean": (sum(v) / len(v)) if v else math.nan, "max": v[-1] if v else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(v, p)
    return out


def summarize(specs, results, *, start: float, cpu_seconds: float | None = None) -> dict:
    """Summarise a run. ``specs`` and ``results`` are parallel lists; ``start`` is the
    perf_counter at which arrival time 0 was taken."""
    n = len(results)
    end = max((r.done for r in results), default=start)
    wall = max(end - start, 1e-9)
    completed = [i for i, r in enumerate(results) if r.ok]
    good = [i for i in completed if _latency(results[i]) * 1000.0 <= specs[i].sla_ms]
    out_tokens = sum(results[i].output_tokens for i in completed)
    by_status = Counter(str(r.status) for r in results if not r.ok)
    by_reason = Counter(r.reason or ("stream-error" if r.status == 200 else "none") for r in results if not r.ok)
    first_error: dict[str, str] = {}  # status -> what the first failure of that status said
    for r in results:
        if not r.ok and r.error and str(r.status) not in first_error:
            first_error[str(r.status)] = r.error
    ttft = [results[i].first_token - results[i].sent for i in completed if results[i].first_token is not None]
    itl = [g for i in completed for g in results[i].gaps]
    summary = {
        "requests": n,
        "completed": len(completed),
        "failed": n - len(completed),
        "good": len(good),
        "duration_s": wall,
        "throughput_rps": len(completed) / wall,
        "goodput_rps": len(good) / wall,
        "goodput_ratio": len(good) / n if n else math.nan,
        # What the gateway admitted and the engines completed, past its SLA: the promise
        # admission makes is that this stays small, whatever the load.
        "admitted_miss_ratio": (len(completed) - len(good)) / len(completed) if completed else math.nan,
        "output_tokens_per_s": out_tokens / wall,
        "latency_ms": distribution((_latency(results[i]) for i in completed), 1000.0),
        "ttft_ms": distribution(ttft, 1000.0),
        "itl_ms": distribution(itl, 1000.0),
        "client_wait_ms": distribution((max(0.0, r.sent - start - s.at) for s, r in zip(specs, results)), 1000.0),
        "rejections": {
            "by_status": dict(sorted(by_status.items())),
            "by_reason": dict(sorted(by_reason.items())),
            "first_error": dict(sorted(first_error.items())),
        },
        "by_band": _by_band(specs, results),
        "by_load": by_load(specs, results),
    }
    summary["peak_completion_rps"] = peak_rate_in_window([results[i].done for i in completed])
    if cpu_seconds is not None:
        summary["client_cpu_us_per_request"] = cpu_seconds / n * 1e6 if n else math.nan
        summary["client_cpu_share"] = cpu_seconds / wall
    return summary


def peak_rate_in_window(times: list[float], window: float = 1.0) -> float:
    """The most events in any ``window`` seconds, per second: under overload, the
    completion rate the servers actually delivered (their capacity for this mix)."""
    t = sorted(times)
    best = 0
    lo = 0
    for hi in range(len(t)):
        while t[hi] - t[lo] > window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window


def _latency(r) -> float:
    return r.done - r.sent


def by_load(specs, results, levels: int = 3) -> list[dict]:
    """Admitted requests past their SLA at each load level: every request is placed by the
    arrival rate of the second of the workload it arrived in, and the seconds are split
    into ``levels`` ranges of that rate, from the lightest to the peak (empty ones left
    out). Per level: its range of arrivals per second, requests, completed, completed past
    the SLA, and their share of the completed (``admitted_miss_ratio``)."""
    if not specs:
        return []
    per_second = Counter(int(s.at) for s in specs)
    top = max(per_second.values())
    rows = [{"rate_min": math.inf, "rate_max": 0, "requests": 0, "completed": 0, "missed": 0} for _ in range(levels)]
    for s, r in zip(specs, results):
        rate = per_second[int(s.at)]
        row = rows[min(levels - 1, (rate - 1) * levels // top)]
        row["rate_min"] = min(row["rate_min"], rate)
        row["rate_max"] = max(row["rate_max"], rate)
        row["requests"] += 1
        if r.ok:
            row["completed"] += 1
            row["missed"] += _latency(r) * 1000.0 > s.sla_ms
    out = []
    for row in rows:
        if row["requests"]:
            row["admitted_miss_ratio"] = row["missed"] / row["completed"] if row["completed"] else math.nan
            out.append(row)
    return out


def _by_band(specs, results) -> dict:
    bands: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        bands.setdefault(s.band or "-", []).append(i)
    out = {}
    for band, idx in sorted(bands.items()):
        done = [i for i in idx if results[i].ok]
        good = [i for i in done if _latency(results[i]) * 1000.0 <= specs[i].sla_ms]
        lat = distribution((_latency(results[i]) for i in done), 1000.0)
        out[band] = {
            "requests": len(idx),
            "completed": len(done),
            "good": len(good),
            "goodput_ratio": len(good) / len(idx),
            "latency_p50_ms": lat["p50"],
            "latency_p99_ms": lat["p99"],
        }
    return out
