"""Who is calling: API keys, tenants and their rate limits, compiled.

The gateway asks on every proxied request (the key check, the tenant, its rate): as C
calls from exchange.pyx rather than Python frames.
"""

from cpython.unicode cimport PyUnicode_GET_LENGTH

from velocity_fast.fleet.lease cimport SharedBucket
from velocity_fast.fleet.shared cimport tenant_slot, vf_cell_config, vf_cell_draw, vf_cell_left, vf_cell_settle
from velocity_fast.lowlevel.clock cimport monotonic

DEFAULT_TENANT = "default"


cdef class Tenant:
    """A configured tenant: its band cap, weight, SLA, token bucket of requests, and
    bucket of engine tokens (``tokens_per_minute``).

    The token bucket holds a minute's tokens and refills at tokens_per_minute / 60 a
    second. A request draws its estimate (prompt bytes / 4 plus max_tokens) when it is
    admitted, and the gateway settles the draw to the tokens the engine served (prompt
    plus completion, from its ``usage``) when the answer ends: the level may fall below
    zero (debt), and then no request is admitted until it has refilled."""

    def __init__(self, cfg):
        self.name = cfg.name
        self.max_band = cfg.max_band
        self.weight = cfg.weight
        self.sla_ms = getattr(cfg, "sla_ms", None)
        self.rate = cfg.requests_per_second
        self.burst = float(cfg.burst if cfg.burst is not None else max(1.0, (self.rate or 0) * 2))
        self.tokens = self.burst
        self.stamp = monotonic()
        self.tpm = getattr(cfg, "tokens_per_minute", None)
        self.rate_c = float(self.rate or 0.0)
        self.tpm_c = float(self.tpm or 0.0)
        self.tlevel = self.tpm_c
        self.tstamp = self.stamp
        self.rejections = {}
        self.shared = self.tshared = None
        # Workers: the buckets are one cell each in the shared state (a limit that changed
        # starts full there, an unchanged one keeps its level); one process: NULL.
        self.shm = NULL
        if self.rate is not None or self.tpm is not None:
            self.shm = tenant_slot(self.name)
            if self.shm != NULL:
                if self.rate is not None:
                    vf_cell_config(&self.shm.req, float(self.rate), self.burst)
                if self.tpm is not None:
                    vf_cell_config(&self.shm.tok, float(self.tpm) / 60.0, float(self.tpm))

    cpdef double take(self) except -1:
        """A token-bucket draw: 0.0 when allowed, else the seconds until one is available."""
        cdef double now, rate
        if self.rate is None:
            return 0.0
        if self.shared is not None:  # the bucket shared through the state store (fleet/statestore.py)
            return (<SharedBucket?>self.shared).draw(1.0, 1.0)
        if self.shm != NULL:  # every worker's draws from one cell
            return vf_cell_draw(&self.shm.req, 1.0, 1.0)
        rate = self.rate_c
        now = monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate

    cdef void _refill(self) noexcept:
        cdef double now = monotonic(), cap = self.tpm_c
        self.tlevel = min(cap, self.tlevel + (now - self.tstamp) * cap / 60.0)
        self.tstamp = now

    cpdef double take_tokens(self, double estimate) except -1:
        """Draw ``estimate`` tokens: 0.0 when they fit in what is left (drawn), else the
        seconds until they would. An estimate past a minute's tokens needs a full bucket."""
        cdef double need, cap
        if self.tpm is None:
            return 0.0
        cap = self.tpm_c
        need = estimate if estimate < cap else cap
        if self.tshared is not None:
            return (<SharedBucket?>self.tshared).draw(estimate, need)
        if self.shm != NULL:
            return vf_cell_draw(&self.shm.tok, estimate, need)
        self._refill()
        if self.tlevel >= need:
            self.tlevel -= estimate
            return 0.0
        return (need - self.tlevel) * 60.0 / cap

    cpdef settle_tokens(self, double delta):
        """The answer ended: ``delta`` more tokens than drawn (less when negative)."""
        if self.tshared is not None:
            (<SharedBucket?>self.tshared).settle(delta)
        elif self.shm != NULL and self.tpm is not None:
            vf_cell_settle(&self.shm.tok, delta)
        elif self.tpm is not None:
            self._refill()
            self.tlevel -= delta

    def tokens_left(self):
        """Tokens left in the bucket now (None: no quota; below 0: in debt)."""
        if self.tpm is None:
            return None
        if self.tshared is not None:
            return self.tshared.left()
        if self.shm != NULL:
            return vf_cell_left(&self.shm.tok)
        self._refill()
        return self.tlevel

    def keep_state(self, Tenant prev):
        """Take over ``prev``'s figures and the buckets whose limits did not change (a
        reload): an unchanged limit keeps its level, a changed one starts full."""
        self.served_prompt = prev.served_prompt
        self.served_cached = prev.served_cached
        self.served_completion = prev.served_completion
        self.rejections = prev.rejections
        if (prev.rate, prev.burst) == (self.rate, self.burst):
            self.tokens, self.stamp = prev.tokens, prev.stamp
        if prev.tpm == self.tpm:
            self.tlevel, self.tstamp = prev.tlevel, prev.tstamp


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
        if type(header) is str:  # (a str's truth without a call)
            if PyUnicode_GET_LENGTH(header):
                return header
            return user or DEFAULT_TENANT
        return header or user or DEFAULT_TENANT

    cdef object tenant_named(self, bound, name):
        """tenant_for's tenant for the name tenant_name gave."""
        if bound is not None:
            return bound
        if name is self._last_name and name is not None:
            return self._last_tenant
        t = self.tenants.get(name)
        if t is not None:
            self._last_name = name
            self._last_tenant = t
        return t
