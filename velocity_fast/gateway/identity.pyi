"""Stubs for velocity_fast.gateway.identity (API keys, tenants, rate limits)."""

from typing import Any

from velocity_fast.state.bucket import Bucket

DEFAULT_TENANT: str

class Tenant:
    name: str
    max_band: str | None
    rate: float | None
    burst: float
    weight: Any
    sla_ms: float | None
    tpm: float | None
    request_bucket: Bucket | None
    token_bucket: Bucket | None
    served_prompt: int
    served_cached: int
    served_completion: int
    rejections: dict[str, int]
    def __init__(self, cfg: Any, store: Any = None) -> None: ...
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
    def __init__(self, settings: Any, store: Any = None) -> None: ...
    @staticmethod
    def presented_key(headers: dict[str, str]) -> str | None: ...
    @staticmethod
    def key_of(auth: str | None, api_key: str | None) -> str | None: ...
    def authenticate(self, headers: dict[str, str]) -> tuple[bool, Tenant | None]: ...
    def authenticate_key(self, key: str | None) -> tuple[bool, Tenant | None]: ...
    def tenant_for(self, bound: Tenant | None, header: str | None, user: str | None) -> tuple[str, Tenant | None]: ...
