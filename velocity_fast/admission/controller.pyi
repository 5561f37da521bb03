"""Stubs for velocity_fast.admission.controller (admission's request path)."""
from typing import Any, Callable, Iterator

OUTCOMES: tuple[str, str, str]
WAIT_BUCKETS: tuple[float, ...]
CONGESTION_FACTOR: float

class Ewma:
    """Exponentially weighted moving average; value is None until the first sample."""
    def __init__(self, alpha: float) -> None: ...
    @property
    def alpha(self) -> float: ...
    @property
    def value(self) -> float | None: ...
    @property
    def seen(self) -> bool: ...
    @property
    def samples(self) -> int: ...
    def observe(self, x: float) -> None: ...

class ServiceEstimate:
    """How long one endpoint takes to serve a request (seconds)."""
    def __init__(self, alpha: float) -> None: ...
    @property
    def ttft(self) -> Ewma: ...
    @property
    def tpot(self) -> Ewma: ...
    @property
    def service(self) -> Ewma: ...
    @property
    def known(self) -> bool: ...
    def observe_first_byte(self, ttft_s: float) -> None: ...
    def observe(self, ttft_s: float | None, service_s: float, tokens: int) -> None: ...
    def predict(self, max_tokens: int) -> float | None: ...
    def snapshot(self) -> dict: ...

class Window:
    """The last maxlen samples, oldest first."""
    def __init__(self, maxlen: int) -> None: ...
    def append(self, x: float) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[float]: ...

class Telemetry:
    """Counters, windows and the metric handles of one Admission."""
    registry: Any
    n_admitted: int
    n_completed: int
    n_failed: int
    n_cancelled: int
    reasons: dict[str, int]
    queue_cancelled: int
    sla_met: int
    sla_missed: int
    @property
    def waits(self) -> list[Window]: ...
    @property
    def e2e(self) -> Window: ...
    @property
    def ttfts(self) -> Window: ...
    def __init__(self, registry: Any, band_names: list[str], window: int, depth_fn: Callable,
                 saturation_fn: Callable, limit_fn: Callable, inflight_fn: Callable) -> None: ...
    def reject(self, reason: str) -> None: ...
    def granted(self, band: int, wait_s: float) -> None: ...
    def finished(self, band: int, outcome: str, e2e_s: float, ttft_s: float | None,
                 sla_met: bool | None) -> None: ...
    def counts(self) -> dict[str, int]: ...

class Ticket:
    """One request as admission sees it."""
    band: str | None
    tenant: str | None
    sla_ms: float | None
    max_tokens: int
    prompt_bytes: int
    model: str | None
    def __init__(self, band: str | None = None, tenant: str | None = None, sla_ms: float | None = None,
                 max_tokens: int | None = 16, prompt_bytes: int = 0, model: str | None = None) -> None: ...

class EndpointState:
    """Admission's private view of one endpoint."""
    ep: Any
    load: Any
    aimd: Any
    est: ServiceEstimate

class PoolState:
    """One pool's queues and what is granted but not yet bound."""
    pool: Any
    queues: Any
    pending: int
    states: list[EndpointState]
    loads: list
    seen: list | None
    overload_until: float

class Lease:
    """An admission slot held for the whole response."""
    band_index: int
    band: str
    tenant: str | None
    max_tokens: int
    deadline: float
    arrived_at: float
    granted_at: float
    bound_at: float
    first_byte_at: float
    endpoint: Any
    done: bool
    @property
    def queue_ms(self) -> float: ...
    def bind(self, ep: Any) -> None: ...
    def rebind(self, ep: Any) -> None: ...
    def fits(self, ep: Any) -> bool: ...
    def first_byte(self) -> None: ...
    def release(self, outcome: str = "completed", error_text: str | None = None, tokens: int = 0) -> None: ...

class AdmissionCore:
    """The compiled half of Admission (admission/controller.py)."""
    settings: Any
    policy: Any
    pools: dict
    clock: Callable[[], float]
    band_names: list[str]
    telemetry: Telemetry
    def admit_nowait(self, ticket: Ticket, waiter: Any) -> Lease | tuple[Any, int]: ...
    def withdraw(self, ticket: Ticket, rid: int) -> bool: ...
    def has_room(self, ep: Any) -> bool: ...
    def prediction(self, model: Any = None, band: str | None = None, max_tokens: int = 16) -> tuple[float, float] | None: ...
