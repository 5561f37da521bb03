"""Admission visibility: the Prometheus metrics (docs/operations.md, "Metrics") that admission
owns, plus the counters and latency windows behind ``Admission.stats()``.

Metrics registered here (all prefixed ``velocity_``): ``admitted_total``,
``completed_total``, ``failed_total``, ``cancelled_total``,
``rejections_total{reason}``, ``queue_depth{band}`` (scrape time),
``queue_wait_seconds{band}`` (histogram), ``pool_saturation{model}``,
``endpoint_limit{endpoint}``, ``endpoint_inflight{endpoint}`` (scrape time),
``ttft_seconds`` and ``request_latency_seconds{band}`` (histograms).

``Telemetry`` is compiled with the request path that counts into it
(_core/admission.pyx); ``percentiles`` serves /stats.
"""

from __future__ import annotations

from .._core.admission import WAIT_BUCKETS, Telemetry

__all__ = ["Telemetry", "percentiles", "WAIT_BUCKETS"]


def percentiles(samples, qs=(50, 90, 99)) -> dict:
    """Nearest-rank percentiles in milliseconds of samples in seconds ({} when empty)."""
    data = sorted(samples)
    if not data:
        return {}
    n = len(data)
    out = {}
    for q in qs:
        k = min(n - 1, max(0, int(round(q / 100.0 * n + 0.5)) - 1))
        out[f"p{q}"] = round(data[k] * 1000.0, 3)
    return out
