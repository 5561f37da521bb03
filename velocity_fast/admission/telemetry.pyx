"""Admission visibility: the Prometheus metrics (docs/operations.md, "Metrics") that admission
owns, plus the counters and latency windows behind ``Admission.stats()``.

Metrics registered here (all prefixed ``velocity_``): ``admitted_total``,
``completed_total``, ``failed_total``, ``cancelled_total``,
``rejections_total{reason}``, ``queue_depth{band}`` (scrape time),
``queue_wait_seconds{band}`` (histogram), ``pool_saturation{model}``,
``endpoint_limit{endpoint}``, ``endpoint_inflight{endpoint}`` (scrape time),
``ttft_seconds`` and ``request_latency_seconds{band}`` (histograms).

``Telemetry`` is compiled: the request path counts into it. ``percentiles`` serves /stats.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc

from velocity_fast.metrics.values cimport HistChild, Value

__all__ = ["Telemetry", "Window", "percentiles", "WAIT_BUCKETS", "OUTCOMES"]

# A lease's outcomes; the request path passes them as ints (OUTCOMES[i] is the name).
OUTCOMES = ("completed", "failed", "cancelled")
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


cdef class Window:
    """The last ``maxlen`` samples (a ring of C doubles: no allocation once made, no float
    object per sample); iterates oldest first."""

    def __cinit__(self, Py_ssize_t maxlen):
        self._maxlen = maxlen if maxlen > 0 else 0
        self._data = <double*>PyMem_Malloc((self._maxlen or 1) * sizeof(double))
        if self._data == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self._data)

    cdef void push(self, double x) noexcept:
        if not self._maxlen:
            return
        self._data[self._next] = x
        self._next += 1
        if self._next == self._maxlen:
            self._next = 0
        if self._n < self._maxlen:
            self._n += 1

    def append(self, double x):
        self.push(x)

    def __len__(self):
        return self._n

    def __iter__(self):
        cdef Py_ssize_t i, start = self._next if self._n == self._maxlen else 0
        return iter([self._data[(start + i) % self._maxlen] for i in range(self._n)])


def reuse_metric(reg, make, name, *args, **kw):
    """The registry's metric ``name``, made with ``make`` if it has none yet (a second
    Admission on the same registry shares the first's)."""
    got = reg.get(name)
    return got if got is not None else make(name, *args, **kw)


def _gauge_fn(reg, name, help, fn, labels, merge):
    got = reg.get(name)
    if got is None:
        reg.gauge_fn(name, help, fn, labels, merge=merge)
    else:
        got.fn = fn


cdef class Telemetry:
    """Counters, windows and the metric handles of one Admission (see the module doc)."""

    def __init__(self, registry, list band_names, Py_ssize_t window, depth_fn, saturation_fn, limit_fn,
                 inflight_fn):
        # Imported here, not at the module's top: there it costs the request path 0.8 %
        # more instructions (bench/ratchet.py, 150b), by what it moves at import.
        from velocity_fast.metrics.registry import MAX, SUM, Registry

        if registry is None:
            registry = Registry()
        self.registry = reg = registry
        # Each worker counts its own requests and queues (SUM); the limits, in-flight and
        # saturation are the shared memory's and the engines' scrapes, whole in each (MAX).
        # A reloaded configuration builds a new Admission on the same registry: take
        # over the metrics already there (counters stay monotonic) instead of failing.
        self.admitted = reuse_metric(reg, reg.counter, "velocity_admitted_total", "Requests admitted (lease granted).",
                                     merge=SUM)
        self.completed = reuse_metric(reg, reg.counter, "velocity_completed_total", "Admitted requests that completed.",
                                      merge=SUM)
        self.failed = reuse_metric(reg, reg.counter, "velocity_failed_total", "Admitted requests that failed.",
                                   merge=SUM)
        self.cancelled = reuse_metric(reg, reg.counter, "velocity_cancelled_total",
                                "Admitted requests cancelled by the client.", merge=SUM)
        self.rejections = reuse_metric(reg, reg.counter, "velocity_rejections_total",
                                 "Requests declined by admission, by reason.", ("reason",), merge=SUM)
        _gauge_fn(reg, "velocity_queue_depth", "Requests waiting in admission queues, by band.", depth_fn,
                  ("band",), SUM)
        self.queue_wait = reuse_metric(reg, reg.histogram, "velocity_queue_wait_seconds",
                                 "Time spent queued before admission.", ("band",), buckets=WAIT_BUCKETS,
                                 merge=SUM)
        _gauge_fn(reg, "velocity_pool_saturation", "Pool saturation (1.0 = saturated).", saturation_fn,
                  ("model",), MAX)
        _gauge_fn(reg, "velocity_endpoint_limit", "Concurrency limit per endpoint (AIMD or fixed).", limit_fn,
                  ("endpoint",), MAX)
        _gauge_fn(reg, "velocity_endpoint_inflight", "Gateway requests in flight per endpoint.", inflight_fn,
                  ("endpoint",), MAX)
        self.ttft = reuse_metric(reg, reg.histogram, "velocity_ttft_seconds", "Time to first byte from arrival.",
                                merge=SUM)
        self.latency = reuse_metric(reg, reg.histogram, "velocity_request_latency_seconds",
                              "End-to-end latency from arrival.", ("band",), merge=SUM)
        # The unlabelled metrics' children, held for the request path: bumped in place.
        self._admitted = self.admitted.labels()
        self._completed = self.completed.labels()
        self._failed = self.failed.labels()
        self._cancelled = self.cancelled.labels()
        self._ttft = self.ttft.labels()
        self._wait_children = [self.queue_wait.labels(b) for b in band_names]
        self._lat_children = [self.latency.labels(b) for b in band_names]
        # This instance's own terminal counts: they must reconcile with its in-flight.
        self.reasons = {}
        self.waits = [Window(window) for _ in band_names]
        self.e2e = Window(window)
        self.ttfts = Window(window)

    cpdef reject(self, str reason):
        """Count one rejection."""
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.rejections.labels(reason).inc()

    cpdef void granted(self, int band, double wait_s) except *:
        """Count one admission after ``wait_s`` in the queue."""
        self.n_admitted += 1
        self._admitted.value += 1.0
        (<HistChild>self._wait_children[band]).observe(wait_s)
        (<Window>self.waits[band]).push(wait_s)

    cpdef void finished(self, int band, int outcome, double e2e_s, double ttft_s, int sla) except *:
        """Count one terminal outcome (``outcome_code``: an index of ``OUTCOMES``) with its
        latencies; ttft_s < 0: no first byte; sla: -1 not judged, 0 missed, 1 met."""
        if outcome == COMPLETED:
            self.n_completed += 1
            self._completed.value += 1.0
            (<HistChild>self._lat_children[band]).observe(e2e_s)
            self.e2e.push(e2e_s)
            if sla == 1:
                self.sla_met += 1
            elif sla == 0:
                self.sla_missed += 1
        elif outcome == FAILED:
            self.n_failed += 1
            self._failed.value += 1.0
        else:
            self.n_cancelled += 1
            self._cancelled.value += 1.0
        if ttft_s >= 0:
            (<HistChild>self._ttft).observe(ttft_s)
            self.ttfts.push(ttft_s)

    def counts(self):
        """Terminal counters as integers."""
        return {"admitted": self.n_admitted, "completed": self.n_completed, "failed": self.n_failed,
                "cancelled": self.n_cancelled}


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
