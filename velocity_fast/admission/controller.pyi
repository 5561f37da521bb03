"""Stubs for velocity_fast.admission.controller (admission's request path)."""

import logging
from collections.abc import Callable
from typing import Any

from velocity_fast.admission.aimd import AimdLimit
from velocity_fast.admission.bands import BandQueues, Item
from velocity_fast.admission.estimators import OutputEstimate, ServiceEstimate
from velocity_fast.admission.pace import EndpointPace, PoolPace
from velocity_fast.admission.saturation import EndpointLoad
from velocity_fast.admission.sla import PoolWork, SlaModel
from velocity_fast.admission.telemetry import OUTCOMES as OUTCOMES
from velocity_fast.admission.telemetry import Telemetry
from velocity_fast.fleet.endpoint import Endpoint, RoomFilter

log: logging.Logger
CONGESTION_FACTOR: float
IDLE_RESET_S: float
STATS_WHOLE: frozenset[str]

class Ticket:
    """One request as admission sees it."""

    band: str | None
    tenant: str | None
    sla_ms: float | None
    max_tokens: int
    prompt_bytes: int
    model: str | None
    def __init__(
        self,
        band: str | None = None,
        tenant: str | None = None,
        sla_ms: float | None = None,
        max_tokens: int | None = 16,
        prompt_bytes: int = 0,
        model: str | None = None,
    ) -> None: ...

class EndpointState:
    """Admission's private view of one endpoint."""
    def __init__(self, ep: Endpoint, limit: int, aimd: AimdLimit, alpha: float) -> None: ...
    @property
    def ep(self) -> Endpoint: ...
    @property
    def load(self) -> EndpointLoad: ...
    @property
    def aimd(self) -> AimdLimit: ...
    @property
    def est(self) -> ServiceEstimate: ...
    @property
    def pace(self) -> EndpointPace: ...
    busy_at: float

class PoolState:
    """One pool's queues and what is granted but not yet bound."""

    pending: int
    states: list[EndpointState]
    loads: list[EndpointLoad]
    seen: list | None
    overload_until: float
    def __init__(self, pool: Any, queues: BandQueues) -> None: ...
    @property
    def pool(self) -> Any: ...
    @property
    def queues(self) -> BandQueues: ...
    @property
    def work(self) -> PoolWork: ...
    @property
    def pace(self) -> PoolPace: ...
    @property
    def open_chat(self) -> OutputEstimate: ...
    @property
    def open_text(self) -> OutputEstimate: ...

class Lease(RoomFilter):
    """Granted by ``Admission.admit``; ``bind`` when an endpoint is chosen, ``release`` at the end."""
    @property
    def band_index(self) -> int: ...
    @property
    def band(self) -> str: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def prompt_bytes(self) -> int: ...
    @property
    def expect_end(self) -> float:
        """When it is expected to end (0: its size could not be estimated at the grant)."""
    @property
    def deadline(self) -> float:
        """Arrival plus its SLA (infinity: no deadline)."""
    @property
    def arrived_at(self) -> float: ...
    @property
    def granted_at(self) -> float: ...
    @property
    def bound_at(self) -> float: ...
    @property
    def first_byte_at(self) -> float: ...
    @property
    def handover_s(self) -> float: ...
    @property
    def endpoint(self) -> Endpoint | None: ...
    @property
    def done(self) -> bool: ...
    @property
    def queue_ms(self) -> float: ...
    @property
    def fair_charged(self) -> float: ...
    @property
    def fair_actual(self) -> float: ...
    @property
    def fair_known(self) -> bool: ...
    def usage(self, prompt: float, cached: float, completion: float) -> None: ...
    def bind(self, ep: Endpoint) -> None: ...
    def rebind(self, ep: Endpoint) -> None: ...
    def claim(self, ep: Endpoint) -> bool: ...
    def force(self, ep: Endpoint) -> None: ...
    def has_room(self, ep: Endpoint) -> bool:
        """Room on ``ep`` for this lease's band: below its limit and its band's ceiling there."""
    def skip_turn(self) -> bool:
        """Batch work that found no engine whose turn had come may take one early (True)."""
    def first_byte(self) -> None: ...
    def handed_over(self) -> None: ...
    def release(self, outcome: str = "completed", error_text: str | None = None, tokens: int = 0) -> None: ...

class Admission:
    """Whether and when each request runs. See docs/internals.md ("Admission")."""

    settings: Any
    policy: Any
    pools: dict
    clock: Callable[[], float]
    band_names: list[str]
    telemetry: Telemetry
    @property
    def sla(self) -> SlaModel: ...
    @property
    def promise_counts(self) -> dict[str, int]:
        """Retry-After times told (``made``) and, of those come due, ``kept`` and ``broken``."""
    def __init__(
        self,
        settings: Any,
        pools: dict,
        policy: Any = "dynamic",
        registry: Any = None,
        clock: Callable[[], float] = ...,
    ) -> None: ...
    async def admit(self, ticket: Ticket) -> Lease:
        """Grant a lease now or after a wait; raise Rejected when declined."""
    def on_metrics(self, ep: Endpoint) -> None:
        """A scrape of ``ep`` landed: update saturation, check KV, maybe dispatch."""
    def housekeep(self) -> None:
        """Judge the Retry-After promises come due, expire TTLs, decline hopeless requests,
        then dispatch (aging)."""
    def close(self) -> None:
        """Stop the housekeeping timer and fail whatever still waits (503)."""
    def stats(self) -> dict:
        """Scheduler statistics for /stats."""
    def known_pools(self) -> dict[str, Any]:
        """Every pool's state, created for pools no request has asked for yet."""
    def queued(self) -> int:
        """Requests waiting in admission, every pool and band."""
    def admit_nowait(self, ticket: Ticket, waiter: Any) -> Lease | Item:
        """Grant a lease now, raise Rejected, or queue ``waiter`` and return its queue Item."""
    def withdraw(self, ticket: Ticket, item: Item) -> bool:
        """Take a queued request out of its queue (its client left); False if no longer queued."""
    def open_estimate(self, model: Any, chat: bool) -> OutputEstimate | None:
        """The output tokens estimate of ``model``'s pool (None: the default pool) for a request
        that names no max tokens, chat or /v1/completions; None: no such pool."""
    def prediction(
        self, model: Any = None, band: str | None = None, max_tokens: int = 16, prompt_bytes: int = 0
    ) -> tuple[float, float] | None:
        """``(wait_s, service_s)`` the SLA check would predict now; None while nothing is known."""
    def has_room(self, ep: Endpoint) -> bool:
        """True when ``ep`` may take one more request now (the router's filter)."""
