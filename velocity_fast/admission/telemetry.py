"""Admission visibility: the Prometheus metrics of DESIGN section 7 that admission
owns, plus the counters and latency windows behind ``Admission.stats()``.

Metrics registered here (all prefixed ``velocity_``): ``admitted_total``,
``completed_total``, ``failed_total``, ``cancelled_total``,
``rejections_total{reason}``, ``queue_depth{band}`` (scrape time),
``queue_wait_seconds{band}`` (histogram), ``pool_saturation{model}``,
``endpoint_limit{endpoint}``, ``endpoint_inflight{endpoint}`` (scrape time),
``ttft_seconds`` and ``request_latency_seconds{band}`` (histograms).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from ..metrics import Registry

__all__ = ["Telemetry", "percentiles"]

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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


def _reuse(reg: Registry, make: Callable, name: str, *args, **kw):
    got = reg.get(name)
    return got if got is not None else make(name, *args, **kw)


def _gauge_fn(reg: Registry, name: str, help: str, fn: Callable, labels: tuple) -> None:
    got = reg.get(name)
    if got is None:
        reg.gauge_fn(name, help, fn, labels)
    else:
        got.fn = fn


class Telemetry:
    """Counters, windows and the metric handles of one Admission."""

    def __init__(self, registry: Registry | None, band_names: list[str], window: int,
                 depth_fn: Callable, saturation_fn: Callable, limit_fn: Callable,
                 inflight_fn: Callable) -> None:
        self.registry = registry if registry is not None else Registry()
        reg = self.registry
        # A reloaded configuration builds a new Admission on the same registry: take
        # over the metrics already there (counters stay monotonic) instead of failing.
        self.admitted = _reuse(reg, reg.counter, "velocity_admitted_total", "Requests admitted (lease granted).")
        self.completed = _reuse(reg, reg.counter, "velocity_completed_total", "Admitted requests that completed.")
        self.failed = _reuse(reg, reg.counter, "velocity_failed_total", "Admitted requests that failed.")
        self.cancelled = _reuse(reg, reg.counter, "velocity_cancelled_total",
                                "Admitted requests cancelled by the client.")
        self.rejections = _reuse(reg, reg.counter, "velocity_rejections_total",
                                 "Requests declined by admission, by reason.", ("reason",))
        _gauge_fn(reg, "velocity_queue_depth", "Requests waiting in admission queues, by band.", depth_fn,
                  ("band",))
        self.queue_wait = _reuse(reg, reg.histogram, "velocity_queue_wait_seconds",
                                 "Time spent queued before admission.", ("band",), buckets=WAIT_BUCKETS)
        _gauge_fn(reg, "velocity_pool_saturation", "Pool saturation (1.0 = saturated).", saturation_fn,
                  ("model",))
        _gauge_fn(reg, "velocity_endpoint_limit", "Concurrency limit per endpoint (AIMD or fixed).", limit_fn,
                  ("endpoint",))
        _gauge_fn(reg, "velocity_endpoint_inflight", "Gateway requests in flight per endpoint.", inflight_fn,
                  ("endpoint",))
        self.ttft = _reuse(reg, reg.histogram, "velocity_ttft_seconds", "Time to first byte from arrival.")
        self.latency = _reuse(reg, reg.histogram, "velocity_request_latency_seconds",
                              "End-to-end latency from arrival.", ("band",))
        # The unlabelled metrics' children, held for the request path: their values
        # are bumped in place (what Counter.inc does, one call less each).
        self._admitted = self.admitted.labels()
        self._completed = self.completed.labels()
        self._failed = self.failed.labels()
        self._cancelled = self.cancelled.labels()
        self._ttft = self.ttft.labels()
        # This instance's own terminal counts: they must reconcile with its in-flight.
        self.n_admitted = self.n_completed = self.n_failed = self.n_cancelled = 0
        self._wait_children = [self.queue_wait.labels(b) for b in band_names]
        self._lat_children = [self.latency.labels(b) for b in band_names]
        self.reasons: dict[str, int] = {}
        self.queue_cancelled = 0
        self.sla_met = 0
        self.sla_missed = 0
        self.waits = [deque(maxlen=window) for _ in band_names]
        self.e2e = deque(maxlen=window)
        self.ttfts = deque(maxlen=window)

    def reject(self, reason: str) -> None:
        """Count one rejection."""
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.rejections.labels(reason).inc()

    def granted(self, band: int, wait_s: float) -> None:
        """Count one admission after ``wait_s`` in the queue."""
        self.n_admitted += 1
        self._admitted.value += 1.0
        self._wait_children[band].observe(wait_s)
        self.waits[band].append(wait_s)

    def finished(self, band: int, outcome: str, e2e_s: float, ttft_s: float | None,
                 sla_met: bool | None) -> None:
        """Count one terminal outcome with its latencies."""
        if outcome == "completed":
            self.n_completed += 1
            self._completed.value += 1.0
            self._lat_children[band].observe(e2e_s)
            self.e2e.append(e2e_s)
            if sla_met is not None:
                if sla_met:
                    self.sla_met += 1
                else:
                    self.sla_missed += 1
        elif outcome == "failed":
            self.n_failed += 1
            self._failed.value += 1.0
        else:
            self.n_cancelled += 1
            self._cancelled.value += 1.0
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
            self.ttfts.append(ttft_s)

    def counts(self) -> dict:
        """Terminal counters as integers."""
        return {"admitted": self.n_admitted, "completed": self.n_completed, "failed": self.n_failed,
                "cancelled": self.n_cancelled}
