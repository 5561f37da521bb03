"""Who is calling: API keys, tenants and their rate limits."""

from __future__ import annotations

import time

from ..config import Settings, TenantConfig

__all__ = ["Identity", "Tenant", "DEFAULT_TENANT"]

DEFAULT_TENANT = "default"


class Tenant:
    __slots__ = ("name", "max_band", "rate", "burst", "tokens", "stamp", "weight")

    def __init__(self, cfg: TenantConfig) -> None:
        self.name = cfg.name
        self.max_band = cfg.max_band
        self.weight = cfg.weight
        self.rate = cfg.requests_per_second
        self.burst = float(cfg.burst if cfg.burst is not None else max(1.0, (self.rate or 0) * 2))
        self.tokens = self.burst
        self.stamp = time.monotonic()

    def take(self) -> float:
        """A token-bucket draw: 0.0 when allowed, else the seconds until one is available."""
        if self.rate is None:
            return 0.0
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Identity:
    """Resolves a request's key to a tenant. With no key configured, everybody may call."""

    def __init__(self, settings: Settings) -> None:
        self.global_key = settings.api_key
        self.tenants = {t.name: Tenant(t) for t in settings.tenants}
        self.by_key = {t.api_key: self.tenants[t.name] for t in settings.tenants if t.api_key}
        self.required = bool(self.global_key or self.by_key)

    @staticmethod
    def presented_key(headers: dict[str, str]) -> str | None:
        auth = headers.get("authorization")
        if auth is not None:
            scheme, _, token = auth.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        return headers.get("x-api-key")

    def authenticate(self, headers: dict[str, str]) -> tuple[bool, Tenant | None]:
        """(allowed, tenant bound to the key or None)."""
        if not self.required:
            return True, None
        key = self.presented_key(headers)
        if key is None:
            return False, None
        t = self.by_key.get(key)
        if t is not None:
            return True, t
        return (key == self.global_key), None

    def tenant_for(self, bound: Tenant | None, header: str | None, user: str | None) -> tuple[str, Tenant | None]:
        """A key's tenant wins; else the x-velocity-tenant header, OpenAI's `user`, or default."""
        if bound is not None:
            return bound.name, bound
        name = header or user or DEFAULT_TENANT
        return name, self.tenants.get(name)
