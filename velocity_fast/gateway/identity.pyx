"""Who is calling: API keys, tenants and their rate limits, compiled.

The gateway asks on every proxied request (the key check, the tenant, its rate): as C
calls from exchange.pyx rather than Python frames.
"""

from velocity_fast.lowlevel.clock cimport monotonic

DEFAULT_TENANT = "default"


cdef class Tenant:
    """A configured tenant: its band cap, weight, SLA, and token bucket of requests."""

    def __init__(self, cfg):
        self.name = cfg.name
        self.max_band = cfg.max_band
        self.weight = cfg.weight
        self.sla_ms = getattr(cfg, "sla_ms", None)
        self.rate = cfg.requests_per_second
        self.burst = float(cfg.burst if cfg.burst is not None else max(1.0, (self.rate or 0) * 2))
        self.tokens = self.burst
        self.stamp = monotonic()

    cpdef double take(self) except -1:
        """A token-bucket draw: 0.0 when allowed, else the seconds until one is available."""
        cdef double now, rate
        if self.rate is None:
            return 0.0
        rate = self.rate
        now = monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate


cdef class Identity:
    """Resolves a request's key to a tenant. With no key configured, everybody may call."""

    def __init__(self, settings):
        self.global_key = settings.api_key
        self.tenants = {t.name: Tenant(t) for t in settings.tenants}
        self.by_key = {t.api_key: self.tenants[t.name] for t in settings.tenants if t.api_key}
        self.required = bool(self.global_key or self.by_key)

    @staticmethod
    def presented_key(dict headers):
        auth = headers.get("authorization")
        if auth is not None:
            scheme, _, token = auth.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        return headers.get("x-api-key")

    cpdef tuple authenticate(self, dict headers):
        """(allowed, tenant bound to the key or None)."""
        if not self.required:
            return True, None
        key = Identity.presented_key(headers)
        if key is None:
            return False, None
        t = self.by_key.get(key)
        if t is not None:
            return True, t
        return (key == self.global_key), None

    cpdef tuple tenant_for(self, bound, header, user):
        """A key's tenant wins; else the x-velocity-tenant header, OpenAI's `user`, or default."""
        name = self.tenant_name(bound, header, user)
        return name, self.tenant_named(bound, name)

    cdef object tenant_name(self, bound, header, user):
        """tenant_for's name, as C (no tuple made)."""
        if bound is not None:
            return bound.name
        return header or user or DEFAULT_TENANT

    cdef object tenant_named(self, bound, name):
        """tenant_for's tenant for the name tenant_name gave."""
        if bound is not None:
            return bound
        return self.tenants.get(name)
