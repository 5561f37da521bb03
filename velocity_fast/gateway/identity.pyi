"""Stubs for velocity_fast.gateway.identity (API keys, tenants, rate limits)."""
from typing import Any

DEFAULT_TENANT: str

class Tenant:
    name: str
    max_band: str | None
    rate: float | None
    burst: float
    tokens: float
    stamp: float
    weight: Any
    sla_ms: float | None
    tpm: float | None
    tlevel: float
    tstamp: float
    served_prompt: int
    served_cached: int
    served_completion: int
    rejections: dict[str, int]
    def __init__(self, cfg: Any) -> None: ...
    def take(self) -> float: ...
    def take_tokens(self, estimate: float) -> float: ...
    def settle_tokens(self, delta: float) -> None: ...
    def tokens_left(self) -> float | None: ...
    def keep_state(self, prev: Tenant) -> None: ...

class Identity:
    global_key: str | None
    tenants: dict[str, Tenant]
    by_key: dict[str, Tenant]
    required: bool
    def __init__(self, settings: Any) -> None: ...
    @staticmethod
    def presented_key(headers: dict[str, str]) -> str | None: ...
    def authenticate(self, headers: dict[str, str]) -> tuple[bool, Tenant | None]: ...
    def tenant_for(self, bound: Tenant | None, header: str | None, user: str | None) -> tuple[str, Tenant | None]: ...
