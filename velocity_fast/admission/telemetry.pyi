"""Stubs for velocity_fast.admission.telemetry (admission's metrics, counters and latency windows)."""

from collections.abc import Callable, Iterable, Iterator
from typing import Any

OUTCOMES: tuple[str, str, str]
WAIT_BUCKETS: tuple[float, ...]

def reuse_metric(reg: Any, make: Callable[..., Any], name: str, *args: Any, **kw: Any) -> Any:
    """The registry's metric ``name``, made with ``make`` if it has none yet."""

class Window:
    """The last ``maxlen`` samples (a ring of C doubles: no object per sample); iterates oldest first."""
    def __init__(self, maxlen: int) -> None: ...
    def append(self, x: float) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[float]: ...

class Telemetry:
    """Counters, windows and the metric handles of one Admission."""

    n_admitted: int
    n_completed: int
    n_failed: int
    n_cancelled: int
    reasons: dict[str, int]
    queue_cancelled: int
    sla_met: int
    sla_missed: int
    def __init__(
        self,
        registry: Any,
        band_names: list[str],
        window: int,
        depth_fn: Callable,
        saturation_fn: Callable,
        limit_fn: Callable,
        inflight_fn: Callable,
    ) -> None: ...
    @property
    def registry(self) -> Any: ...
    @property
    def admitted(self) -> Any: ...
    @property
    def completed(self) -> Any: ...
    @property
    def failed(self) -> Any: ...
    @property
    def cancelled(self) -> Any: ...
    @property
    def rejections(self) -> Any: ...
    @property
    def queue_wait(self) -> Any: ...
    @property
    def ttft(self) -> Any: ...
    @property
    def latency(self) -> Any: ...
    @property
    def waits(self) -> list[Window]: ...
    @property
    def e2e(self) -> Window: ...
    @property
    def ttfts(self) -> Window: ...
    def reject(self, reason: str) -> None:
        """Count one rejection."""
    def granted(self, band: int, wait_s: float) -> None:
        """Count one admission after ``wait_s`` in the queue."""
    def finished(self, band: int, outcome: int, e2e_s: float, ttft_s: float, sla: int) -> None:
        """Count one terminal outcome (``outcome_code``: an index of ``OUTCOMES``) with its
        latencies; ttft_s < 0: no first byte; sla: -1 not judged, 0 missed, 1 met."""
    def counts(self) -> dict[str, int]:
        """Terminal counters as integers."""

def percentiles(samples: Iterable[float], qs: Iterable[int] = (50, 90, 99)) -> dict:
    """Nearest-rank percentiles in milliseconds of samples in seconds ({} when empty)."""
