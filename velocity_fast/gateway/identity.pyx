"""Who is calling: API keys, tenants and their rate limits, compiled.

The gateway asks on every proxied request (the key check, the tenant, its rate): as C
calls from ingress.pyx rather than Python frames.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_GET_LENGTH
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

from velocity_fast.fleet.lease cimport SharedBucket
from velocity_fast.fleet.shared cimport tenant_slot, vf_cell_config, vf_cell_draw, vf_cell_left, vf_cell_settle
from velocity_fast.lowlevel.clock cimport monotonic

DEFAULT_TENANT = "default"


cdef class Tenant:
    """A configured tenant: its band cap, weight, SLA, token bucket of requests, and
    bucket of engine tokens (``tokens_per_minute``).

    The token bucket holds a minute's tokens and refills at tokens_per_minute / 60 a
    second. A request draws its estimate (prompt bytes / 4 plus max_tokens, or without
    one its pool's learned reply length, admission/estimators.pyx) when it is admitted, and the gateway settles the draw to the tokens the engine served (prompt
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
        _tokens_refill(self, monotonic())

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


cdef enum:
    HEADER_SLOTS = 4096  # a power of two: 1,000 tenants' names mostly each in a slot of its own


cdef inline unsigned int _header_hash(const char* p, Py_ssize_t n) noexcept nogil:
    """A hash of ``p[:n]`` (1 <= n <= 32) from three 8-byte words, the first, the middle and
    the last (fewer bytes: those), as http/message.pyx's texts."""
    cdef uint64_t a = 0, b = 0, c = 0, h
    cdef Py_ssize_t i
    if n >= 8:
        memcpy(&a, p, 8)
        memcpy(&b, p + (n >> 1) - 4, 8)
        memcpy(&c, p + n - 8, 8)
    else:
        for i in range(n):  # (no memcpy call for a length not known when compiled)
            a |= <uint64_t>(<unsigned char>p[i]) << (8 * i)
    h = (a * 0x9E3779B97F4A7C15ULL) ^ (b * 0xC2B2AE3D27D4EB4FULL) ^ (c * 0x165667B19E3779F9ULL) ^ <uint64_t>n
    h ^= h >> 29
    return <unsigned int>(h ^ (h >> 32))


cdef class Identity:
    """Resolves a request's key to a tenant. With no key configured, everybody may call."""

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._slots != NULL:
            for i in range(HEADER_SLOTS):
                Py_XDECREF(self._slots[i].tenant)
            PyMem_Free(self._slots)
            self._slots = NULL
        Py_XDECREF(self._last_header.tenant)
        self._last_header.tenant = NULL

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

    cdef Tenant by_header(self, const char* p, Py_ssize_t n):
        """The tenant an x-velocity-tenant header of these bytes named before (keep_header),
        or None: not seen, or its slot taken by another since."""
        cdef HeaderSlot* slot
        cdef Py_ssize_t i
        if self._slots == NULL or n <= 0 or n > 32:
            return None
        slot = &self._slots[_header_hash(p, n) & (HEADER_SLOTS - 1)]
        if slot.n != n:
            return None
        for i in range(n):  # (a short name: no memcmp call)
            if slot.raw[i] != p[i]:
                return None
        if self._last_header.tenant != slot.tenant:
            Py_INCREF(<Tenant>slot.tenant)
            Py_XDECREF(self._last_header.tenant)
            self._last_header.tenant = slot.tenant
        memcpy(self._last_header.raw, p, n)
        self._last_header.n = n
        return <Tenant>slot.tenant

    cdef void keep_header(self, const char* p, Py_ssize_t n, Tenant t) except *:
        """An x-velocity-tenant header of these bytes named ``t`` (by tenant_named): the
        next one finds it by by_header."""
        cdef HeaderSlot* slot
        if n <= 0 or n > 32:
            return
        if self._slots == NULL:
            self._slots = <HeaderSlot*>PyMem_Malloc(HEADER_SLOTS * sizeof(HeaderSlot))
            if self._slots == NULL:
                raise MemoryError()
            memset(self._slots, 0, HEADER_SLOTS * sizeof(HeaderSlot))
        slot = &self._slots[_header_hash(p, n) & (HEADER_SLOTS - 1)]
        Py_INCREF(t)
        Py_XDECREF(slot.tenant)
        slot.tenant = <PyObject*>t
        memcpy(slot.raw, p, n)
        slot.n = n
