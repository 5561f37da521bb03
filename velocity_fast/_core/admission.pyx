"""Admission's request path, compiled: tickets, leases, the dispatch cycle and its books.

``AdmissionCore`` holds what every request touches: arrival (``admit_nowait``), the
dispatch cycle, grant, bind, release and what is learned at the end (estimators, AIMD,
telemetry). ``velocity_fast.admission.Admission`` is its Python subclass and keeps the
rest: construction, SLA prediction, housekeeping, out-of-memory shedding, /stats.
The rules are those of admission/controller.py's module doc; this file only types
them. The estimators, the telemetry and the ticket live here too because the request
path reads their fields on every call: their Python modules re-export them.
"""

cimport cython
from cpython.long cimport PyLong_FromVoidPtr

import logging
import math

from asyncio import get_running_loop

from libc.math cimport INFINITY, ceil

from velocity_fast._core.aimd cimport AimdLimit
from velocity_fast._core.bands cimport BandQueues, Item
from velocity_fast._core.clock cimport monotonic
from velocity_fast._core.endpoint cimport Endpoint, pool_endpoints, same_endpoints
from velocity_fast._core.metric_values cimport HistChild, Value
from velocity_fast._core.saturation cimport EndpointLoad, Saturation, free_slots, refresh

from velocity_fast._core.bands import REJECT_BAND_BYTES, REJECT_BAND_COUNT

log = logging.getLogger("velocity.admission")

OUTCOMES = ("completed", "failed", "cancelled")
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# A lease's outcomes, as ints on the request path (OUTCOMES[i] is the name).
cdef enum:
    _COMPLETED = 0
    _FAILED = 1
    _CANCELLED = 2

# An engine slower than this many times its usual service time, on a request that
# missed its SLA, counts as congested (AIMD cuts its limit).
CONGESTION_FACTOR = 1.5
cdef double _CONGESTION = 1.5
cdef str _OOM_TEXT = "out of memory"


cdef inline int _outcome(str outcome) except -1:
    if outcome == "completed":
        return _COMPLETED
    if outcome == "failed":
        return _FAILED
    if outcome == "cancelled":
        return _CANCELLED
    raise ValueError(f"outcome must be one of {OUTCOMES}, not {outcome!r}")


# -- estimators -------------------------------------------------------------------------

cdef class Ewma:
    """Exponentially weighted moving average; ``value`` is None until the first sample."""

    def __cinit__(self, double alpha):
        self.alpha = alpha

    @property
    def value(self):
        return self._value if self.seen else None

    cdef void add(self, double x):
        self.samples += 1
        if not self.seen:
            self._value = x
            self.seen = True
        else:
            self._value += self.alpha * (x - self._value)

    def observe(self, double x):
        """Fold one sample in."""
        self.add(x)


cdef class ServiceEstimate:
    """How long one endpoint takes to serve a request (seconds). Each estimate starts
    unknown; until a first observation the prediction says nothing, so a cold gateway
    never rejects on a guess."""

    def __cinit__(self, double alpha):
        self.ttft = Ewma(alpha)
        self.tpot = Ewma(alpha)
        self.service = Ewma(alpha)

    cdef void first_byte(self, double ttft_s):
        if ttft_s >= 0:
            self.ttft.add(ttft_s)

    cdef void done(self, double ttft_s, double service_s, long tokens):
        # ttft_s < 0: no first byte was seen
        if ttft_s >= 0 and tokens > 1 and service_s > ttft_s:
            self.tpot.add((service_s - ttft_s) / (tokens - 1))
        self.service.add(service_s)

    cdef double expect(self, long max_tokens):
        """The prediction, or -1 when unknown."""
        if not self.ttft.seen:
            return self.service._value if self.service.seen else -1.0
        cdef double per = self.tpot._value if self.tpot.seen else 0.0
        return self.ttft._value + (max_tokens - 1 if max_tokens > 1 else 0) * per

    def observe_first_byte(self, double ttft_s):
        """A first byte came back ``ttft_s`` after dispatch. Learned at once, not at
        the end, so that a gateway under its first long requests can already predict."""
        self.first_byte(ttft_s)

    def observe(self, ttft_s, double service_s, long tokens):
        """One finished request: dispatch to first byte (None: none seen; already fed
        through ``observe_first_byte``), dispatch to end, tokens out."""
        self.done(-1.0 if ttft_s is None else <double>ttft_s, service_s, tokens)

    @property
    def known(self):
        """True once a first byte or a whole request has been seen here."""
        return self.ttft.seen or self.service.seen

    def predict(self, long max_tokens):
        """Expected service time of a request asking ``max_tokens``; None if unknown."""
        cdef double s = self.expect(max_tokens)
        return None if s < 0 else s

    def snapshot(self):
        """Current estimates in milliseconds (None when unknown)."""
        def ms(Ewma e):
            return round(e._value * 1000.0, 3) if e.seen else None
        return {"ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "service_ms": ms(self.service),
                "samples": self.service.samples}


# -- telemetry --------------------------------------------------------------------------

cdef class Window:
    """The last ``maxlen`` samples (a ring: no allocation once full); iterates oldest first."""

    def __cinit__(self, Py_ssize_t maxlen):
        self._data = []
        self._maxlen = maxlen if maxlen > 0 else 0
        self._next = 0

    cpdef append(self, x):
        if len(self._data) < self._maxlen:
            self._data.append(x)
        elif self._maxlen:
            self._data[self._next] = x
            self._next += 1
            if self._next == self._maxlen:
                self._next = 0

    def __len__(self):
        return len(self._data)

    def __iter__(self):
        return iter(self._data[self._next:] + self._data[:self._next])


def _reuse(reg, make, name, *args, **kw):
    got = reg.get(name)
    return got if got is not None else make(name, *args, **kw)


def _gauge_fn(reg, name, help, fn, labels):
    got = reg.get(name)
    if got is None:
        reg.gauge_fn(name, help, fn, labels)
    else:
        got.fn = fn


cdef class Telemetry:
    """Counters, windows and the metric handles of one Admission (see telemetry.py)."""

    def __init__(self, registry, list band_names, Py_ssize_t window, depth_fn, saturation_fn, limit_fn,
                 inflight_fn):
        if registry is None:
            from velocity_fast.metrics import Registry
            registry = Registry()
        self.registry = reg = registry
        # A reloaded configuration builds a new Admission on the same registry: take
        # over the metrics already there (counters stay monotonic) instead of failing.
        self.admitted = _reuse(reg, reg.counter, "velocity_admitted_total", "Requests admitted (lease granted).")
        self.completed = _reuse(reg, reg.counter, "velocity_completed_total", "Admitted requests that completed.")
        self.failed = _reuse(reg, reg.counter, "velocity_failed_total", "Admitted requests that failed.")
        self.cancelled = _reuse(reg, reg.counter, "velocity_cancelled_total",
                                "Admitted requests cancelled by the client.")
        self.rejections = _reuse(reg, reg.counter, "velocity_rejections_total",
                                 "Requests declined by admission, by reason.", ("reason",))
        _gauge_fn(reg, "velocity_queue_depth", "Requests waiting in admission queues, by band.", depth_fn,
                  ("band",))
        self.queue_wait = _reuse(reg, reg.histogram, "velocity_queue_wait_seconds",
                                 "Time spent queued before admission.", ("band",), buckets=WAIT_BUCKETS)
        _gauge_fn(reg, "velocity_pool_saturation", "Pool saturation (1.0 = saturated).", saturation_fn,
                  ("model",))
        _gauge_fn(reg, "velocity_endpoint_limit", "Concurrency limit per endpoint (AIMD or fixed).", limit_fn,
                  ("endpoint",))
        _gauge_fn(reg, "velocity_endpoint_inflight", "Gateway requests in flight per endpoint.", inflight_fn,
                  ("endpoint",))
        self.ttft = _reuse(reg, reg.histogram, "velocity_ttft_seconds", "Time to first byte from arrival.")
        self.latency = _reuse(reg, reg.histogram, "velocity_request_latency_seconds",
                              "End-to-end latency from arrival.", ("band",))
        # The unlabelled metrics' children, held for the request path: bumped in place.
        self._admitted = self.admitted.labels()
        self._completed = self.completed.labels()
        self._failed = self.failed.labels()
        self._cancelled = self.cancelled.labels()
        self._ttft = self.ttft.labels()
        self._wait_children = [self.queue_wait.labels(b) for b in band_names]
        self._lat_children = [self.latency.labels(b) for b in band_names]
        # This instance's own terminal counts: they must reconcile with its in-flight.
        self.reasons = {}
        self.waits = [Window(window) for _ in band_names]
        self.e2e = Window(window)
        self.ttfts = Window(window)

    cpdef reject(self, str reason):
        """Count one rejection."""
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.rejections.labels(reason).inc()

    cdef void _granted(self, int band, double wait_s) except *:
        self.n_admitted += 1
        self._admitted.value += 1.0
        (<HistChild>self._wait_children[band]).observe(wait_s)
        (<Window>self.waits[band]).append(wait_s)

    cdef void _finished(self, int band, int outcome, double e2e_s, double ttft_s, int sla) except *:
        # ttft_s < 0: no first byte; sla: -1 not judged, 0 missed, 1 met
        if outcome == _COMPLETED:
            self.n_completed += 1
            self._completed.value += 1.0
            (<HistChild>self._lat_children[band]).observe(e2e_s)
            self.e2e.append(e2e_s)
            if sla == 1:
                self.sla_met += 1
            elif sla == 0:
                self.sla_missed += 1
        elif outcome == _FAILED:
            self.n_failed += 1
            self._failed.value += 1.0
        else:
            self.n_cancelled += 1
            self._cancelled.value += 1.0
        if ttft_s >= 0:
            (<HistChild>self._ttft).observe(ttft_s)
            self.ttfts.append(ttft_s)

    def granted(self, int band, double wait_s):
        """Count one admission after ``wait_s`` in the queue."""
        self._granted(band, wait_s)

    def finished(self, int band, str outcome, double e2e_s, ttft_s, sla_met):
        """Count one terminal outcome with its latencies (ttft_s, sla_met: None when unknown)."""
        self._finished(band, _outcome(outcome), e2e_s, -1.0 if ttft_s is None else <double>ttft_s,
                       -1 if sla_met is None else (1 if sla_met else 0))

    def counts(self):
        """Terminal counters as integers."""
        return {"admitted": self.n_admitted, "completed": self.n_completed, "failed": self.n_failed,
                "cancelled": self.n_cancelled}


# -- what admission is asked --------------------------------------------------------------

@cython.freelist(256)  # one per request: reused, not allocated and freed each time
cdef class Ticket:
    """One request as admission sees it.

    ``band``: band name (None or unknown: the default band); ``tenant``: fairness
    key (None: anonymous); ``sla_ms``: the deadline the client asked for (None: no
    SLA prediction, the default deadline still counts for compliance);
    ``max_tokens``: output tokens asked for; ``prompt_bytes``: body size (queue byte
    limits, token fairness); ``model``: the pool (None: the default pool).
    """

    def __init__(self, band=None, tenant=None, sla_ms=None, max_tokens=16, prompt_bytes=0, model=None):
        self.band = band
        self.tenant = tenant
        self.sla_ms = sla_ms
        # None (the client did not say) counts as vLLM's completions default.
        self.max_tokens = int(max_tokens) if max_tokens is not None else 16
        self.prompt_bytes = int(prompt_bytes or 0)
        self.model = model

    def __repr__(self):
        return (f"Ticket(band={self.band!r}, tenant={self.tenant!r}, sla_ms={self.sla_ms}, "
                f"max_tokens={self.max_tokens}, prompt_bytes={self.prompt_bytes}, model={self.model!r})")


# -- admission's state --------------------------------------------------------------------

cdef class EndpointState:
    """Admission's private view of one endpoint."""

    def __init__(self, Endpoint ep, long limit, AimdLimit aimd, double alpha):
        self.ep = ep
        self.aimd = aimd
        self.load = EndpointLoad(limit)
        self.est = ServiceEstimate(alpha)
        ep.limit = limit


cdef class PoolState:
    """One pool's queues and what is granted but not yet bound."""

    def __init__(self, pool, BandQueues queues):
        self.pool = pool
        self.queues = queues
        self.states = []
        self.loads = []
        self.seen = None


# -- the waiter -----------------------------------------------------------------------------

cdef class Waiter(Listener):
    """A queued request's waiter that the dispatch cycle drives with C calls (the gateway's
    exchange is one). Any other waiter is driven through ``done()`` and ``set_result()``,
    like an asyncio future; rejections always go through ``set_exception()``. It extends
    the engine connection's C listener (upstream.pyx) because the one class that is
    both, the exchange, can have only one compiled base."""

    cdef bint waiting(self) except -1:
        """True while the request still waits for a lease (``not done()``)."""
        return False

    cdef void granted(self, Lease lease) except *:
        """The lease is granted (``set_result(lease)``): schedule the work, do not run it."""
        pass


cdef inline object _key(obj):
    """``id(obj)`` without the call to the builtin."""
    return PyLong_FromVoidPtr(<void*>obj)


cdef inline bint _waiting(waiter) except -1:
    """A queued request's waiter still waits: a Waiter asked as C, a future as a future."""
    if isinstance(waiter, Waiter):
        return (<Waiter>waiter).waiting()
    return not waiter.done()


# -- the lease ----------------------------------------------------------------------------

@cython.freelist(256)  # one per request
cdef class Lease(RoomFilter):
    """Granted by ``Admission.admit``; ``bind`` when an endpoint is chosen,
    ``first_byte`` when the engine answers, ``release`` exactly once at the end
    (further calls are ignored).

    ``bind``/``release`` keep ``Endpoint.inflight`` up to date: nobody else should.
    Useful attributes: ``band`` (name), ``queue_ms``, ``endpoint``, ``deadline``.
    """

    @property
    def queue_ms(self):
        """Time spent waiting in admission, in milliseconds."""
        return (self.granted_at - self.arrived_at) * 1000.0

    cpdef bind(self, Endpoint ep):
        """The request is now in flight on ``ep``."""
        if self.endpoint is None:
            self.rebind(ep)

    cpdef rebind(self, Endpoint ep):
        """Move the request to ``ep`` (a retry elsewhere before any byte was sent);
        the first call binds it."""
        cdef Endpoint old
        if self.done:
            return
        old = self.endpoint
        if old is not None:
            self._adm._on_unbind(self, old)
        self.endpoint = ep
        self.bound_at = self._adm._now()
        self._adm._on_bind(self, ep, old is not None)

    cpdef bint fits(self, Endpoint ep) except -1:
        """Room on ``ep`` for this lease's band (the router's filter): below the
        endpoint's limit and below the band's ceiling on this endpoint too — the pool
        may have headroom on another endpoint, and a request must not take slots that
        this engine cannot run (its learned batch) or that are kept for higher bands."""
        return self._adm._fits(self, ep)

    cdef bint room(self, Endpoint ep) except -1:
        return self._adm._fits(self, ep)

    cpdef first_byte(self):
        """The first byte of the response came back (time-to-first-token)."""
        if not self.first_byte_at and not self.done:
            self.first_byte_at = self._adm._now()
            if self.endpoint is not None:
                self._st.est.first_byte(self.first_byte_at - self.bound_at)

    cpdef release(self, str outcome="completed", error_text=None, long tokens=0):
        """End the lease with one terminal outcome (idempotent)."""
        if self.done:
            return
        cdef int o = _outcome(outcome)
        self.done = True
        self._adm._on_release(self, o, error_text, tokens)

    def __repr__(self):
        ep = getattr(self.endpoint, "name", None)
        return f"<Lease band={self.band} endpoint={ep} done={self.done}>"


# -- the controller's request path ----------------------------------------------------------

cdef class AdmissionCore:
    """The compiled half of ``Admission`` (admission/controller.py): see the module doc."""

    def _configure(self, sat_model=None, bint fixed=False):
        """Read the settings and the policy's switches the request path uses. ``sat_model``:
        the policy's compiled Saturation, when it is EngineSaturation; ``fixed``: its
        saturation is FixedConcurrency. Anything else is called as the Policy interface says."""
        import time
        s, p = self.settings, self.policy
        self._mono = self.clock is time.monotonic
        self._sat = sat_model
        self._fixed = fixed
        self._sat_obj = p.saturation
        self._sla_s = s.sla_ms / 1000.0
        self._sla_tol = s.sla_tolerance
        self._sla_tol_high = s.sla_tolerance_high
        self._global_capacity = s.global_capacity or 0
        self._kv_hard_limit = s.kv_hard_limit
        self._ttft_slo_ms = s.ttft_slo_ms
        self._tick_s = s.tick_ms / 1000.0
        self._oom_throttle = p.oom_throttle
        self._sla_reject = p.sla_reject
        self._adaptive = p.adaptive

    cdef double _now(self) except? -1.0:
        if self._mono:
            return monotonic()
        return self.clock()

    cdef double _pool_sat(self, PoolState ps, double now) except? -1.0:
        cdef EndpointLoad e
        if self._sat is not None:
            return self._sat.pool(ps.loads, ps.pending, now)
        if self._fixed:
            for e in ps.loads:
                if e.healthy:
                    return 0.0
            return INFINITY
        return self._sat_obj.pool(ps.loads, ps.pending, now)

    cdef double _endpoint_sat(self, EndpointLoad load, double now) except? -1.0:
        if self._sat is not None:
            return self._sat.endpoint(load, now, 0.0)
        if self._fixed:
            return 0.0
        return self._sat_obj.endpoint(load, now)

    # -- arrival ----------------------------------------------------------------------------

    def admit_nowait(self, Ticket ticket, waiter):
        """Grant a lease now, raise Rejected, or queue ``waiter`` and return its queue Item
        (``item.waiter`` is the waiter).

        ``waiter`` is a future or any object with ``done()``, ``set_result(lease)`` and
        ``set_exception(rejected)`` (called from the dispatch cycle: it must only
        schedule its work); None queues a new future. ``withdraw`` takes it back.
        """
        return self._admit(ticket, waiter)

    cdef object _admit(self, Ticket ticket, waiter):
        cdef double now = self._now()
        cdef PoolState ps = self._pools.get(ticket.model)
        cdef int band
        cdef double deadline, budget, sat
        cdef long room, cap
        cdef long long rid
        cdef Item item
        cdef BandQueues q
        if ps is None:
            ps = self._state_of(ticket.model)
        if ps is None or not self._refresh(ps):
            raise self._reject(503, "no-endpoint", "no healthy endpoint serves this model", 1)
        # No band name, or an unknown one: the default band (one band: its index 0 is
        # both the only name's and the default's).
        name = ticket.band
        band = self._band_of.get(name, self._default_band) if name else self._default_band
        if self._oom_throttle and band > 0 and now < ps.overload_until:
            raise self._reject(503, "overload", "an engine ran out of memory; shedding non-high work",
                               max(1, <long>ceil(ps.overload_until - now)))
        # The SLA: the request's own (or its tenant's, filled in by the gateway), else the
        # server's. Either is a real deadline: predicted, declined early, judged.
        sla_ms = ticket.sla_ms
        budget = <double>sla_ms / 1000.0 if sla_ms is not None and sla_ms > 0 else self._sla_s
        deadline = now + budget
        q = ps.queues
        # Free slots on the pool's endpoints: nothing below binds or frees one, so the
        # count holds until this call returns.
        room = free_slots(ps.seen, ps.pending)
        # Nothing queued at or above this band: no one to overtake, go at once. A request
        # that goes at once is never declined on a prediction (an idle pool is the
        # plainest case): no wait of the gateway's making stands between it and its SLA.
        sat = -1.0
        if (q.count == 0 or q.count_through(band) == 0) and room > 0:
            sat = self._pool_sat(ps, now)
            if sat < <double>self._ceilings[band]:
                return self._grant(ps, band, ticket.tenant, ticket.max_tokens, deadline, now, now)
        if self._sla_reject:
            self._check_sla(ps, band, ticket.max_tokens, budget, room, sat, now)
        # With one pool (the common case) its queue is all that waits.
        cap = self._global_capacity
        if cap and (q.count if len(self._pools) == 1 else self._queued()) >= cap:
            raise self._reject(503, "capacity", "admission queues are full", 1)
        if waiter is None:
            waiter = get_running_loop().create_future()
        # The queue orders by its own fields.
        # The queue's deadline, by which a waiting request is dropped as hopeless, allows
        # the band's tolerance as the prediction at arrival did; the grant keeps the SLA.
        item = q.push(waiter, ticket.tenant, band, ticket.prompt_bytes, ticket.max_tokens,
                      now + budget * (1.0 + self._tolerance(band)), now, &rid)
        if item is None:
            what = "band" if rid in (REJECT_BAND_COUNT, REJECT_BAND_BYTES) else "admission"
            raise self._reject(503, "capacity", f"{what} queue is full ({self.band_names[band]})", 1)
        # What the grant needs rides with the item, as worked out here (the same
        # deadline from the same arrival time).
        item.grant_deadline = deadline
        item.max_tokens = ticket.max_tokens
        if room > 0:  # else the cycle would stop at once (the pool was just refreshed)
            self._cycle(ps, now, True)
        # Under load the tick is already armed: no need to ask the waiter.
        if self._tick is None and _waiting(waiter):
            self._arm()
        return item

    def withdraw(self, Ticket ticket, Item item):
        """Take a queued request out of its queue (its client left); False if no longer queued."""
        return self._withdraw(ticket, item)

    cdef bint _withdraw(self, Ticket ticket, Item item) except -1:
        cdef PoolState ps
        if item is None:
            return False
        ps = self._state_of(ticket.model)
        if ps is None or not ps.queues.holds(item):
            return False
        ps.queues._remove(item)
        self.telemetry.queue_cancelled += 1
        return True

    cdef double _predict(self, PoolState ps, int band, long max_tokens, long room, double sat, double now,
                         double* wait) except? -2.0:
        """The expected service of a request of ``band`` asking ``max_tokens``, arriving
        now, on the fastest healthy endpoint (-1 when no estimate is known yet); its
        expected queue wait goes to ``wait``. ``room``: free slots in the pool;
        ``sat``: the pool's saturation when the caller already counted it (else < 0)."""
        cdef EndpointState st
        cdef EndpointLoad load
        cdef double service = -1.0, s, mean = 0.0, slots = 0.0, cap, w, ceiling
        cdef long known = 0, ahead, free
        wait[0] = 0.0
        for st in ps.states:
            if not st.ep.healthy:
                continue
            s = st.est.expect(max_tokens)
            if s >= 0.0 and (service < 0.0 or s < service):
                service = s
            if st.est.service.seen:
                mean += st.est.service._value
                known += 1
            # What the engine runs at once: its limit, or its learned batch when smaller.
            load = st.load
            cap = <double>st.ep.limit
            if load.capacity_known and load.capacity < cap:
                cap = load.capacity
            slots += cap
        if service < 0.0:
            return -1.0
        mean = mean / known if known else service
        ceiling = self._ceilings[band]
        if ceiling < 1.0:
            slots *= ceiling  # the share of each engine this band may hold
        if slots < 1.0:
            slots = 1.0
        # Queue model: the requests ahead (queued at or above this band) and this one
        # take the free slots this band may use, then the engines' slots in rounds of
        # ``mean`` seconds. Whole rounds: a flood's batch starts together and ends
        # together, so the first one queued waits a whole service, not a share of one
        # (in a steady stream this overstates the wait by less than one service).
        ahead = ps.queues.count_through(band)
        free = room if room > 0 else 0
        if free > 0:
            if sat < 0.0:
                sat = self._pool_sat(ps, now)
            if sat >= ceiling:
                free = 0  # the room there is kept for higher bands
        w = (ahead + 1 - free) / slots
        wait[0] = ceil(w) * mean if w > 0.0 else 0.0
        return service

    cdef double _tolerance(self, int band):
        """How far past its SLA a prediction may go before a 429: the first band's own."""
        return self._sla_tol_high if band == 0 else self._sla_tol

    cdef void _check_sla(self, PoolState ps, int band, long max_tokens, double budget, long room, double sat,
                         double now) except *:
        """A request that cannot go at once: raise Rejected (429 ``sla``) when its
        predicted completion, the queue wait ahead of it plus its own service, passes
        its SLA (with the band's tolerance). Unknown estimates predict nothing: a cold
        gateway never declines on a guess."""
        cdef double wait = 0.0, predicted
        cdef double service = self._predict(ps, band, max_tokens, room, sat, now, &wait)
        if service < 0.0:
            return
        predicted = wait + service
        if predicted > budget * (1.0 + self._tolerance(band)):
            # Retry-After: once the queue ahead has drained, a request goes at once, and one
            # that goes at once is not declined on a prediction.
            raise self._reject(
                429, "sla", f"predicted completion {predicted * 1000:.0f} ms exceeds the SLA of "
                f"{budget * 1000:.0f} ms", max(1, <long>ceil(wait)))

    def prediction(self, model=None, band=None, long max_tokens=16):
        """``(wait_s, service_s)`` that the SLA check would predict for a request of
        ``band`` (name; None: the default) and ``max_tokens`` arriving now in ``model``'s
        pool (None: the default pool); None while nothing is known."""
        cdef PoolState ps = self._state_of(model)
        cdef int b = self._band_of.get(band, self._default_band) if band else self._default_band
        cdef double wait = 0.0, service
        if ps is None or not self._refresh(ps):
            return None
        service = self._predict(ps, b, max_tokens, free_slots(ps.seen, ps.pending), -1.0, self._now(), &wait)
        return None if service < 0.0 else (wait, service)

    def has_room(self, Endpoint ep):
        """True when ``ep`` may take one more request now (the router's filter)."""
        return ep.healthy and ep.inflight < ep.limit

    cdef bint _fits(self, Lease lease, Endpoint ep) except -1:
        cdef EndpointState st
        cdef EndpointLoad load
        cdef double ceiling
        if not (ep.healthy and ep.inflight < ep.limit):
            return False
        ceiling = self._ceilings[lease.band_index]
        if ceiling == INFINITY:  # a band never held back (static's one band)
            return True
        st = self._known_state(ep)
        if st is None:
            return True
        load = st.load
        load.inflight = ep.inflight
        load.limit = ep.limit
        return self._endpoint_sat(load, self._now()) < ceiling

    def _reject(self, int status, str reason, str message, retry_after):
        # Imported here: the admission package imports this module while it loads.
        from velocity_fast.admission.ticket import Rejected
        self.telemetry.reject(reason)
        return Rejected(status, reason, message, retry_after)

    # -- pools and endpoints ------------------------------------------------------------------

    def _pool_state(self, model):
        """The state of ``model``'s pool (None: the default pool), made on first use;
        None when there is no such pool. A pool once known keeps its state even after
        it left ``pools`` (its queue may still hold requests): a look-up in ``_pools``
        is this method's answer when it finds one."""
        return self._state_of(model)

    cdef PoolState _state_of(self, model):
        pools = self.pools
        if model is None or model not in pools:
            if model is not None and model in self._pools:
                return self._pools[model]
            model = next(iter(pools), None) if model is None else model
            if model is None or model not in pools:
                return None
        ps = self._pools.get(model)
        if ps is None:
            ps = self._pools[model] = PoolState(pools[model], self.policy.make_queues(self.settings))
        return ps

    def _endpoint_state(self, Endpoint ep):
        return self._ep_state(ep)

    cdef EndpointState _known_state(self, Endpoint ep):
        """``ep``'s state if admission knows it, else None. The last one found is kept:
        with one endpoint (or a run of requests to one) no dict look-up, no id. States
        are made once per endpoint and never replaced, so the kept one stays right."""
        if ep is self._last_ep:
            return self._last_st
        # A state holds its endpoint: while it is in _eps, no other object can have
        # that id (the check on st.ep is a guard, not a case that arises).
        st = self._eps.get(_key(ep))
        if st is None or (<EndpointState>st).ep is not ep:
            return None
        self._last_ep = ep
        self._last_st = <EndpointState>st
        return <EndpointState>st

    cdef EndpointState _ep_state(self, Endpoint ep):
        cdef EndpointState st = self._known_state(ep)
        cdef AimdLimit aimd
        if st is None:
            s = self.settings
            if self._adaptive:
                aimd = AimdLimit(s.aimd_min, s.aimd_max, s.aimd_initial or s.aimd_max, s.oom_cooldown_ms / 1000.0)
                st = EndpointState(ep, aimd.limit, aimd, s.ewma_alpha)
            else:
                st = EndpointState(ep, s.aimd_max, None, s.ewma_alpha)
            self._eps[_key(ep)] = st
        return st

    def _sync(self, PoolState ps):
        """Refresh the compiled loads from the endpoints; True if any is healthy."""
        return self._refresh(ps)

    cdef bint _refresh(self, PoolState ps) except -1:
        cdef EndpointState st
        cdef list eps = pool_endpoints(ps.pool)
        # The pool has not changed since the last cycle: the same endpoints.
        if not same_endpoints(ps.seen, eps):
            ps.states = [self._ep_state(e) for e in eps]
            ps.loads = [st.load for st in ps.states]
            ps.seen = list(eps)
        return refresh(ps.loads, ps.seen)

    def _queued_total(self):
        return self._queued()

    cdef long _queued(self) except -1:
        cdef PoolState ps
        cdef long n = 0
        for ps in self._pools.values():
            n += ps.queues.count
        return n

    # -- the dispatch cycle -------------------------------------------------------------------

    def _dispatch(self, PoolState ps, now=None):
        """One cycle for ``ps``; ``now``: the caller's own reading of the clock, when
        it has just taken one (the cycle runs at the moment of what triggered it)."""
        self._cycle(ps, 0.0 if now is None else <double>now, now is not None)

    cdef void _cycle(self, PoolState ps, double now, bint have_now) except *:
        cdef BandQueues q = ps.queues
        cdef long room
        cdef bint healthy, have_sat = False
        cdef double sat = 0.0, ceiling
        cdef int band, nbands
        cdef Item item
        if q.count == 0:
            return
        # No room on the endpoints already known: nothing can go whatever the loads
        # say (most calls under full load), so their refresh is skipped. A pool whose
        # endpoints changed is refreshed first: a new endpoint may bring the room. The
        # same pool needs only its loads refreshed, which reads the endpoints without
        # changing them: the room counted before still holds.
        if same_endpoints(ps.seen, pool_endpoints(ps.pool)):
            room = free_slots(ps.seen, ps.pending)
            if room <= 0:
                return
            healthy = refresh(ps.loads, ps.seen)
        else:
            healthy = self._refresh(ps)
            room = free_slots(ps.seen, ps.pending)
        if not healthy:
            return
        if not have_now:
            now = self._now()
        # Nothing but the grants below changes the room in this cycle: each takes one.
        # Nor the pool's saturation: it is counted when first needed and again after
        # each grant (one more pending lease), not once per band.
        nbands = len(self._ceilings)
        for band in range(nbands):
            ceiling = self._ceilings[band]
            while True:
                if room <= 0:
                    return
                if not have_sat:
                    sat = self._pool_sat(ps, now)
                    have_sat = True
                if sat >= ceiling:
                    return
                item = q.pop(band, now)
                if item is None:
                    break
                fut = item.waiter
                if not _waiting(fut):
                    continue
                room -= 1
                have_sat = False
                lease = self._grant(ps, item.band, item.tenant, item.max_tokens, item.grant_deadline,
                                    item.enqueued_at, now)
                if isinstance(fut, Waiter):
                    (<Waiter>fut).granted(lease)
                else:
                    fut.set_result(lease)

    cdef Lease _grant(self, PoolState ps, int band, tenant, long max_tokens, double deadline, double arrived_at,
                      double now):
        cdef Lease lease = Lease.__new__(Lease)
        ps.pending += 1
        self._in_flight += 1
        self.telemetry._granted(band, now - arrived_at)
        lease._adm = self
        lease._ps = ps
        lease.band_index = band
        lease.band = self.band_names[band]
        lease.tenant = tenant
        lease.max_tokens = max_tokens
        lease.deadline = deadline
        lease.arrived_at = arrived_at
        lease.granted_at = now
        return lease

    # -- leases -------------------------------------------------------------------------------

    cdef void _on_bind(self, Lease lease, Endpoint ep, bint rebind) except *:
        cdef PoolState ps = lease._ps
        cdef EndpointState st
        if not rebind:
            ps.pending -= 1
        ep.inflight += 1
        # An endpoint admission knows already (the common case) needs no call.
        st = self._known_state(ep)
        lease._st = st if st is not None else self._ep_state(ep)
        if not rebind and ps.queues.count:
            # Pending leases count in full on every endpoint (saturation.pool): now
            # that this one has a place, the others' headroom is known again. With
            # nothing queued there is nobody to hand it to.
            self._cycle(ps, 0.0, False)

    cdef void _on_unbind(self, Lease lease, Endpoint ep) except *:
        ep.inflight -= 1
        self._cycle(lease._ps, 0.0, False)

    cdef void _on_release(self, Lease lease, int outcome, error_text, long tokens) except *:
        cdef double now = self._now()
        cdef PoolState ps = lease._ps
        cdef int sla = -1
        cdef Endpoint ep = lease.endpoint
        self._in_flight -= 1
        if outcome == _COMPLETED:
            sla = 1 if now <= lease.deadline else 0
        self.telemetry._finished(lease.band_index, outcome, now - lease.arrived_at,
                                 lease.first_byte_at - lease.arrived_at if lease.first_byte_at else -1.0, sla)
        if ep is None:
            ps.pending -= 1
        else:
            ep.inflight -= 1
            self._learn(ps, lease, ep, outcome, error_text, tokens, now)
        self._cycle(ps, now, True)

    cdef void _learn(self, PoolState ps, Lease lease, Endpoint ep, int outcome, error_text, long tokens,
                     double now) except *:
        cdef EndpointState st = lease._st
        cdef double engine_ttft = lease.first_byte_at - lease.bound_at if lease.first_byte_at else -1.0
        cdef double engine_s = now - lease.bound_at
        cdef double expected = -1.0
        cdef long n = tokens if tokens else lease.max_tokens
        cdef AimdLimit aimd
        cdef bint slow, missed
        # What this engine usually takes for such a request, before this sample counts.
        expected = st.est.expect(n)
        if outcome == _COMPLETED:
            st.est.done(engine_ttft, engine_s, n)
        aimd = st.aimd
        if aimd is None:
            return
        if error_text and _OOM_TEXT in error_text.lower():
            self._on_oom(ps, st, now)
            return
        if outcome != _COMPLETED:
            return
        slow = engine_ttft >= 0 and engine_ttft * 1000.0 > self._ttft_slo_ms
        # A miss is the engine's doing only if its own part overran the whole budget
        # (time queued in the gateway is not cured by a smaller engine limit) and it
        # was slower than usual: an SLA no engine could meet says nothing of load.
        missed = (engine_s > lease.deadline - lease.arrived_at
                  and expected >= 0 and engine_s > _CONGESTION * expected)
        if slow or missed:
            aimd.on_breach(lease.bound_at, now)
        else:
            aimd.on_sample(ps.queues.count > 0, ep.inflight + 1 >= ep.limit,
                           st.load.kv <= self._kv_hard_limit, now)
        ep.limit = <int>aimd.value

    # -- housekeeping -------------------------------------------------------------------------

    def _arm_tick(self):
        self._arm()

    cdef void _arm(self) except *:
        if self._tick is None:
            self._tick = get_running_loop().call_later(self._tick_s, self._on_tick)
