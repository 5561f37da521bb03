"""Who is calling: API keys, tenants and their rate limits, compiled.

The gateway asks on every proxied request (the key check, the tenant, its rate): as C
calls from ingress.pyx rather than Python frames.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_GET_LENGTH
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

from velocity_fast.state.bucket cimport Bucket

from velocity_fast.state.bucket import make_bucket

DEFAULT_TENANT = "default"


cdef class Tenant:
    """A configured tenant: its band cap, weight, SLA, bucket of requests
    (``requests_per_second``, ``burst``) and bucket of engine tokens
    (``tokens_per_minute``), each where the config puts it (state/bucket.pyx: this
    process, the workers' shared memory, or the state store).

    The token bucket holds a minute's tokens and refills at tokens_per_minute / 60 a
    second. A request draws its estimate (prompt bytes / 4 plus max_tokens, or without
    one its pool's learned reply length, admission/estimators.pyx) when it is admitted, and the gateway settles the draw to the tokens the engine served (prompt
    plus completion, from its ``usage``) when the answer ends: the level may fall below
    zero (debt), and then no request is admitted until it has refilled."""

    def __init__(self, cfg, store=None):
        self.name = cfg.name
        self.max_band = cfg.max_band
        self.weight = cfg.weight
        self.sla_ms = getattr(cfg, "sla_ms", None)
        self.rate = cfg.requests_per_second
        self.burst = float(cfg.burst if cfg.burst is not None else max(1.0, (self.rate or 0) * 2))
        self.tpm = getattr(cfg, "tokens_per_minute", None)
        self.rejections = {}
        if self.rate is not None:
            self.request_bucket = make_bucket(self.name, "requests", float(self.rate), self.burst, store)
        if self.tpm is not None:
            self.token_bucket = make_bucket(self.name, "tokens", float(self.tpm) / 60.0, float(self.tpm), store)

    cpdef double take(self) except -1:
        """A request-bucket draw: 0.0 when allowed, else the seconds until one is available."""
        if self.request_bucket is None:
            return 0.0
        return self.request_bucket.draw_at(1.0, 1.0, 0.0)

    cpdef double take_tokens(self, double estimate) except -1:
        """Draw ``estimate`` tokens: 0.0 when they fit in what is left (drawn), else the
        seconds until they would. An estimate past a minute's tokens needs a full bucket."""
        return tenant_draw_tokens(self, estimate, 0.0)

    cpdef settle_tokens(self, double delta):
        """The answer ended: ``delta`` more tokens than drawn (less when negative)."""
        tenant_settle_tokens(self, delta)

    def tokens_left(self):
        """Tokens left in the bucket now (None: no quota; below 0: in debt)."""
        if self.token_bucket is None:
            return None
        return self.token_bucket.left()

    def keep_state(self, Tenant prev):
        """Take over ``prev``'s figures and the buckets whose limits did not change (a
        reload): an unchanged limit keeps its level, a changed one starts full."""
        self.served_prompt = prev.served_prompt
        self.served_cached = prev.served_cached
        self.served_completion = prev.served_completion
        self.rejections = prev.rejections
        if self.request_bucket is not None and prev.request_bucket is not None:
            self.request_bucket.take_over(prev.request_bucket)
        if self.token_bucket is not None and prev.token_bucket is not None:
            self.token_bucket.take_over(prev.token_bucket)


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

    def __init__(self, settings, store=None):
        """``store``: the state store the tenants' buckets live in (None: this process,
        or the workers' shared memory)."""
        self.global_key = settings.api_key
        self.tenants = {t.name: Tenant(t, store) for t in settings.tenants}
        self.by_key = {t.api_key: self.tenants[t.name] for t in settings.tenants if t.api_key}
        self.required = bool(self.global_key or self.by_key)

    @staticmethod
    def presented_key(dict headers):
        return Identity.key_of(headers.get("authorization"), headers.get("x-api-key"))

    @staticmethod
    def key_of(auth, api_key):
        """The key a request presents, from its Authorization and X-Api-Key values (None
        for a header it lacks): a Bearer token first, else X-Api-Key, else None."""
        if auth is not None:
            scheme, _, token = auth.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        return api_key

    cpdef tuple authenticate(self, dict headers):
        """(allowed, tenant bound to the key or None)."""
        return self.authenticate_key(Identity.presented_key(headers))

    cpdef tuple authenticate_key(self, key):
        """authenticate for the key a request presented (key_of; None: none)."""
        if not self.required:
            return True, None
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
        # Kept found or not: with no tenants configured every request names the default
        # tenant, and its look-up would be repeated per request. The tenants are fixed
        # once the Identity serves (a reload makes a new one).
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
