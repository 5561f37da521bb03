"""Stubs for velocity_fast.admission.estimators (per-endpoint and per-pool estimators behind SLA
prediction, by request size)."""

class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""
    def __init__(self, alpha: float) -> None: ...
    @property
    def alpha(self) -> float: ...
    @property
    def value(self) -> float | None: ...
    @property
    def seen(self) -> bool: ...
    @property
    def samples(self) -> int: ...
    def observe(self, x: float) -> None:
        """Fold one sample in."""

class ServiceEstimate:
    """How long one endpoint (or pool) takes to serve a request of a given size (seconds);
    unknown until a first observation."""
    def __init__(self, alpha: float) -> None: ...
    @property
    def ttft(self) -> Ewma: ...
    @property
    def tpot(self) -> Ewma: ...
    @property
    def service(self) -> Ewma: ...
    @property
    def streams(self) -> int:
        """Streams seen (their first tokens teach the first-token line)."""
    @property
    def known(self) -> bool:
        """True once a first byte or a whole request has been seen here."""
    def observe_first_byte(self, ttft_s: float) -> None:
        """A first byte came back ``ttft_s`` after dispatch (a negative time is not learned)."""
    def observe(self, ttft_s: float, service_s: float, tokens: int, nbytes: float = 0.0) -> None:
        """One finished request: dispatch to first byte (negative: none seen), dispatch to end,
        tokens out, the prompt's size in bytes."""
    def predict(self, max_tokens: int, prompt_bytes: float = 0.0) -> float | None:
        """Expected service time of a request of ``prompt_bytes`` asking ``max_tokens``; None if unknown."""
    def snapshot(self) -> dict:
        """Current estimates in milliseconds (None when unknown)."""

OPEN_START_CHAT: int
OPEN_START_TEXT: int
OPEN_WINDOW: int

class OutputEstimate:
    """The completion tokens of a pool's requests that name no max tokens: ``start`` until the
    first answer, then the mean of the last ``OPEN_WINDOW`` answers' completion tokens."""
    def __init__(self, start: float) -> None: ...
    @property
    def start(self) -> float: ...
    @property
    def mean(self) -> float: ...
    @property
    def answers(self) -> int: ...
    def expect(self) -> int:
        """The tokens to take such a request for (at least one)."""
    def observe(self, tokens: int) -> None:
        """One such request answered whole with ``tokens`` completion tokens (none: not learned)."""
    def snapshot(self) -> dict:
        """For /stats: the tokens taken now, the answers learned from, the starting value."""
