"""Stubs for velocity_fast.admission.sla (the band-SLA queue model and its Retry-After promises)."""

from typing import Any

from velocity_fast.admission.bands import BandQueues

RETRY_MARGIN: float
RETRY_MAX_S: float

class PoolWork:
    """One pool's work admitted and queued, and the promises told ahead of it."""

    busy_end: float
    busy_n: int
    queued_work: float
    promises: Any
    promised_work: float
    last_promise: float
    def __init__(self, queues: BandQueues) -> None: ...
    @property
    def queues(self) -> BandQueues: ...

class SlaModel:
    """The queue model and the promise ledger of one admission controller."""

    promise_counts: dict[str, int]
    promise_metric: Any
    def __init__(
        self,
        ceilings: list[float],
        soft_scales: list[float],
        tolerance: float,
        tolerance_high: float,
        promise_metric: Any = None,
    ) -> None: ...
