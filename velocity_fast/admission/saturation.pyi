"""Stubs for velocity_fast.admission.saturation (engine and pool saturation)."""

QUEUE_THRESHOLD: float
KV_THRESHOLD: float
STALE_AFTER_S: float

class EndpointLoad:
    """What saturation knows of one endpoint."""

    inflight: int
    limit: int
    healthy: bool
    bound_n: float
    bound_tokens: float
    bound_t: float
    pace: float
    kv_tokens: float
    out_share: float
    batch_next: float
    kv_fixed: float
    def __init__(self, limit: int = 1) -> None: ...
    def kv_ahead(self, now: float) -> float:
        """The share of the KV cache the requests bound here will still add as they decode."""
    def kv_peak(self, extra_n: float = 0.0, extra_tokens: float = 0.0) -> float:
        """The most of the KV cache its usage will reach as the batch requests bound here
        decode and end (``extra_tokens`` over ``extra_n`` more, not bound yet)."""
    def bind_work(self, max_tokens: float, at: float, sign: float) -> None:
        """A batch request bound here (sign 1) or gone (sign -1), at its bind time."""
    @property
    def running(self) -> float: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv(self) -> float: ...
    @property
    def scraped_at(self) -> float: ...
    @property
    def capacity(self) -> float: ...
    @property
    def capacity_known(self) -> bool: ...
    @property
    def queue_seen(self) -> bool: ...
    @property
    def value(self) -> float: ...
    @property
    def others(self) -> float:
        """Other gateways' running requests on this engine, as the last scrape showed them."""
    def observe(self, running: float, waiting: float, kv: float, scraped_at: float, decoded: float = -1.0) -> None: ...

def observe_endpoint(load: EndpointLoad, ep: object) -> None:
    """Record ``ep``'s latest scrape in ``load``, with other gateways' work (``others``)."""

def refresh(loads: list[EndpointLoad], eps: list) -> bool:
    """Bring each load up to date with its endpoint; True if any is healthy."""

def free_slots(eps: list, pending: int) -> int:
    """Free slots of the healthy endpoints below their limits, less ``pending``."""

class Saturation:
    """The saturation formula with its thresholds."""
    def __init__(self, queue_threshold: float = 5.0, kv_threshold: float = 0.8, stale_after: float = 1.0) -> None: ...
    @property
    def queue_threshold(self) -> float: ...
    @property
    def kv_threshold(self) -> float: ...
    @property
    def stale_after(self) -> float: ...
    def endpoint(
        self,
        load: EndpointLoad,
        now: float,
        extra: float = 0.0,
        soft_scale: float = 1.0,
        extra_tokens: float = 0.0,
        peak_cap: float = 0.0,
    ) -> float: ...
    def update(
        self,
        load: EndpointLoad,
        running: float,
        waiting: float,
        kv: float,
        scraped_at: float,
        now: float,
    ) -> float: ...
    def pool(
        self,
        loads: list[EndpointLoad],
        pending: float,
        now: float,
        soft_scale: float = 1.0,
        pending_tokens: float = 0.0,
        peak_cap: float = 0.0,
    ) -> float: ...
