# cython: annotation_typing=False
"""The admission controller: admit, queue, dispatch, reject; leases and AIMD glue.

One dispatch cycle per pool: visit bands from the highest; a band dispatches while
the pool's saturation is below its ceiling and some endpoint has room (in-flight
below its limit, outstanding leases counted); stop at the first band that may not.
Ceilings never rise as priority falls, so once a band may not go, no lower one may
either: there is no priority inversion. Items aged up from a lower band are handed
out under the ceiling of the band they have risen to.

The cycle runs when a request arrives, when a lease ends, after a scrape
(``on_metrics``) and on a housekeeping tick while anything is queued (TTL expiry,
aging, hopeless requests). Queued requests wait on asyncio futures; cancelling the
task that awaits ``admit`` removes its request from the queue at once.

Here too: tickets (what admission is asked), leases (a slot held for the whole
response), the per-pool and per-endpoint books. What every request touches is typed C;
the rooms it asks are compiled beside it and called as C: the band-SLA queue model with
its Retry-After promises (sla.pyx), the decode pace (pace.pyx), the estimators and the
telemetry (estimators.pyx, telemetry.pyx).
"""

cimport cython
from cpython.long cimport PyLong_FromVoidPtr

import asyncio
import logging
import math
import time

from asyncio import get_running_loop

from libc.math cimport INFINITY, ceil, floor

from velocity_fast.admission.aimd cimport AimdLimit
from velocity_fast.admission.bands cimport BandQueue, BandQueues, Item, TenantQueue
from velocity_fast.lowlevel.clock cimport event_now
from velocity_fast.fleet.endpoint cimport Endpoint, lease_endpoints, same_endpoints
from velocity_fast.state.shm cimport (inflight_add, inflight_claim, inflight_total, older_elsewhere, overcommitted,
                                      pool_slot, publish_limit, publish_queue, queued_elsewhere, reserve, unreserve)
from velocity_fast.metrics.values cimport HistChild, Value
from velocity_fast.admission.saturation cimport (EndpointLoad, Saturation, free_slots, observe_endpoint, refresh,
                                                sync_shared)
from velocity_fast.admission.estimators cimport Ewma, OutputEstimate, ServiceEstimate
from velocity_fast.admission.telemetry cimport Telemetry, CANCELLED, COMPLETED, FAILED, outcome_code
from velocity_fast.admission.pace cimport EndpointPace, PoolPace, need_now, note_grant
from velocity_fast.admission.pace cimport observe as observe_pace
from velocity_fast.admission.sla cimport PoolWork, SlaModel

from velocity_fast.admission.telemetry import OUTCOMES, reuse_metric, percentiles

from velocity_fast.admission.bands import REJECT_BAND_BYTES, REJECT_BAND_COUNT
from velocity_fast.admission.estimators import OPEN_START_CHAT, OPEN_START_TEXT
from velocity_fast.admission.errors import Rejected
from velocity_fast.admission.policies import EngineSaturation, FixedConcurrency, Policy, make_policy
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.metrics.registry import SUM

__all__ = ["Admission", "Lease", "Ticket", "OUTCOMES", "STATS_WHOLE"]

log = logging.getLogger("velocity.admission")

# Admission.stats()'s numbers that every worker reports whole (the shared limits, in-flight
# and band ceilings, the engines' scrapes, what each learns of the same engine): several
# workers' /stats take the largest (gateway/stats_merge.py); the rest is each one's share.
STATS_WHOLE = frozenset({"ceiling", "oldest_wait_ms", "wait_ms", "saturation", "overload_s", "limit", "inflight",
                         "others", "batch_capacity", "running_max", "frozen", "estimates"})


# The numbers live in csrc/admission_consts.h (what each means is said there).
CONGESTION_FACTOR = VF_CONGESTION_FACTOR
IDLE_RESET_S = VF_IDLE_RESET_S
cdef str _OOM_TEXT = "out of memory"


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


cdef inline void _set_limit(Endpoint ep, long limit):
    """This gateway's concurrency limit on ``ep``; with workers, told to the others too
    (the smallest a worker set holds for all: state/shm.pyx)."""
    ep.limit = limit
    if ep.shm != NULL:
        publish_limit(ep.shm, limit)


# -- workers: the pool's share of the shared state (state/shm.pxd) ------------------------

cdef bint _reserve(PoolState ps) except -1:
    """One reservation more of the pool's, across the workers, if they stay within the
    limits of its healthy endpoints: a grant made so finds an engine with room at its bind."""
    cdef long cap = 0
    cdef Endpoint ep
    for ep in ps.seen:
        if ep.healthy:
            cap += ep.limit
    return reserve(ps.shm, cap)


cdef inline bint _others_queued(PoolState ps, int band) noexcept:
    """Another worker holds requests queued in ``band`` or a higher one."""
    return queued_elsewhere(ps.shm, band)


cdef void _publish(PoolState ps) except *:
    """This worker's queue depth per band, and when its oldest item there came, for the
    others."""
    cdef BandQueues q = ps.queues
    cdef BandQueue bq
    cdef Py_ssize_t above = 0, through
    cdef int b
    for b in range(q.nbands):
        through = q.count_through(b)
        bq = <BandQueue>q.bands[b]
        publish_queue(ps.shm, b, through - above, bq.age_head.enqueued_at if bq.age_head is not None else 0.0)
        above = through


cdef inline bint _older_elsewhere(PoolState ps, int band) noexcept:
    """Another worker's queue holds an item of ``band`` that came before this worker's
    oldest there: a slot freed here is that one's (first come, first served across the
    workers; it takes the slot at its next cycle, its tick at the latest)."""
    cdef BandQueue bq = <BandQueue>ps.queues.bands[band]
    if bq.age_head is None:
        return False
    return older_elsewhere(ps.shm, band, bq.age_head.enqueued_at)


# -- admission's state --------------------------------------------------------------------

cdef class EndpointState:
    """Admission's private view of one endpoint."""

    def __init__(self, Endpoint ep, long limit, AimdLimit aimd, double alpha):
        self.ep = ep
        self.aimd = aimd
        self.load = EndpointLoad(limit)
        self.est = ServiceEstimate(alpha)
        self.pace = EndpointPace()
        self.busy_at = -INFINITY
        _set_limit(ep, limit)


cdef class PoolState:
    """One pool's queues and what is granted but not yet bound."""

    def __init__(self, pool, BandQueues queues, double alpha=0.2):
        self.pool = pool
        self.queues = queues
        self.states = []
        self.loads = []
        self.seen = None
        self.est = ServiceEstimate(alpha)
        self.work = PoolWork(queues)
        self.pace = PoolPace()
        self.higher_at = -INFINITY
        self.held_at = -INFINITY
        self.open_chat = OutputEstimate(OPEN_START_CHAT)
        self.open_text = OutputEstimate(OPEN_START_TEXT)


cdef inline bint _kv_held(EndpointLoad load, double now, double stale_after) noexcept:
    """The engine's KV cache is what holds work back there (EndpointLoad.held_by_cache),
    on a fresh scrape: its turn to probe is over."""
    return now - load.scraped_at <= stale_after and load.held_by_cache(now)


cdef double _borrowed(PoolState ps, double now, double stale_after, double ceiling) noexcept:
    """The ceiling a deadline-free band may fill while no higher band has asked for a
    while: all of each engine's batch but one slot (of the smallest batch), or its own
    ceiling when that is more. Only where the gateway knows every engine's batch and no
    other gateway's work shows on them: a guessed batch, or another replica or worker
    whose higher-band work this one cannot see, keeps the ceiling. An engine whose KV
    cache is what holds its batch (``_kv_held``) is known by its cache: its batch is
    what the cache, as it will be once its requests have decoded, has room for (the
    saturation's projected KV term), under its limit, and that is borrowed as a count."""
    cdef EndpointLoad e
    cdef double cap, least = INFINITY, b
    for e in ps.loads:
        if not e.healthy:
            continue
        if e.others > 0.0 and now - e.scraped_at <= stale_after:
            return ceiling
        if e.capacity_known:
            cap = e.capacity if e.capacity < <double>e.limit else <double>e.limit
        elif _kv_held(e, now, stale_after):
            cap = <double>e.limit
        else:
            return ceiling
        if cap < least:
            least = cap
    if least == INFINITY or least < 2.0:
        return ceiling
    b = 1.0 - 1.0 / least + 1e-9
    return b if b > ceiling else ceiling


cdef void _space_batch(PoolState ps, double max_tokens, double now, double cap) noexcept:
    """A batch request was granted: the next may follow once the pool's caches take one
    more, at the rate of all its engines' batch_interval together. Batch requests
    granted together end together, and then hold every answer whole at the same moment
    (kv_peak's peak is their sum); bound one after another, evenly over an answer's time,
    they hold half as much on average, and twice as many fit under the band's share of
    the cache. The pool grants at that rate and each engine takes its turn
    (Lease.has_room, batch_next), so the first wave of a flood is spread as well as the
    waves that would follow it."""
    cdef EndpointLoad e
    cdef double rate = 0.0, dt
    for e in ps.loads:
        if e.healthy:
            dt = e.batch_interval(max_tokens, cap)
            if dt > 0.0:
                rate += 1.0 / dt
    if rate <= 0.0:
        return
    if ps.batch_next < now:
        ps.batch_next = now
    ps.batch_next += 1.0 / rate


cdef void _space_engine(EndpointLoad e, double max_tokens, double now, double cap) noexcept:
    """A batch request was bound to e: its next waits one batch_interval."""
    cdef double dt = e.batch_interval(max_tokens, cap)
    if dt <= 0.0:
        return
    if e.batch_next < now:
        e.batch_next = now
    e.batch_next += dt


cdef bint _in_turn(PoolState ps, EndpointState st, double now, double stale_after) noexcept:
    """Whether ``st``'s limit may grow now. An engine whose batch is not learned finds it
    only by overshooting it, and the requests past its batch wait in its FIFO queue,
    where a high request sent there waits behind them until the first of the batch end.
    So the engines of a pool probe one at a time, in order: the others keep their limits,
    whose low share leaves slots free that the router sends high work to. An engine's
    turn comes once each before it is done probing (its batch learned, its limit at the
    maximum, its slow start ended, or its KV cache what holds it: ``_kv_held``) and shows
    no queue of its own on a fresh scrape."""
    cdef EndpointState o
    cdef AimdLimit a
    if st.load.capacity_known:
        return True
    for o in ps.states:
        if o is st:
            return True
        if not o.ep.healthy:
            continue
        a = o.aimd
        if (a is not None and not o.load.capacity_known and a.decreases == 0 and a.ooms == 0
                and a.value < a.maximum and not _kv_held(o.load, now, stale_after)):
            return False  # still probing
        if now - o.load.scraped_at <= stale_after and o.load.waiting >= 1.0:
            return False  # its overshoot still waits there: no second engine without room
    return True


cdef inline void _unqueue(PoolState ps, Item item):
    """``item`` left ``ps``'s queue: its expected service is no longer ahead of anyone."""
    cdef PoolWork w = ps.work
    if item.service > 0.0:
        w.queued_work -= item.service
    if ps.queues.count == 0 or w.queued_work < 0.0:
        w.queued_work = 0.0


# -- the waiter -----------------------------------------------------------------------------

cdef inline object _key(obj):
    """``id(obj)`` without the call to the builtin."""
    return PyLong_FromVoidPtr(<void*>obj)


# -- the lease ----------------------------------------------------------------------------

# No @cython.freelist: Cython keeps one only for a base class, and Lease extends RoomFilter
# (it ignored the decorator here, with a warning at every build).
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

    cpdef bint claim(self, Endpoint ep) except -1:
        """Bind to ``ep`` if it has room, as every worker counts it: True, else False
        (nothing bound). One process: a bind."""
        cdef long long n
        if ep.shm != NULL and not self.done:
            n = inflight_claim(ep.shm, ep.limit)
            if n < 0:
                ep.inflight = inflight_total(ep.shm, ep.inflight)
                return False
            self._claimed = True
        self.rebind(ep)
        return True

    cpdef force(self, Endpoint ep):
        """Bind to ``ep`` past its limit: every engine was claimed full by other workers
        between the grant and the bind (a limit lowered meanwhile). Counted."""
        overcommitted(ep.shm)
        self.rebind(ep)

    cpdef bint has_room(self, Endpoint ep) except -1:
        """Room on ``ep`` for this lease's band (the router's filter): below the
        endpoint's limit and below the band's ceiling on this endpoint too — the pool
        may have headroom on another endpoint, and a request must not take slots that
        this engine cannot run (its learned batch) or that are kept for higher bands."""
        cdef Admission adm = self._adm
        cdef EndpointState st
        cdef EndpointLoad load
        cdef double ceiling, now
        cdef bint ok
        if ep.shm != NULL:
            sync_shared(ep, None)
        if not (ep.healthy and ep.inflight < ep.limit):
            return False
        ceiling = adm._ceilings[self.band_index]
        if ceiling == INFINITY:  # a band never held back (static's one band)
            return True
        st = adm._known_state(ep)
        if st is None:
            return True
        now = adm._now()
        if self.band_index >= adm._borrow_from:
            ceiling = adm._ceiling(self._ps, self.band_index, now)
        load = st.load
        if (ceiling >= 1.0 and not load.capacity_known and load.waiting >= 2.0 and adm._sat is not None
                and now - load.scraped_at <= adm._sat.stale_after):
            # An engine queueing before its batch is learned (a probe's overshoot): a band
            # meant to find room would wait behind that low work. Another engine, even a
            # full one, serves it sooner; with none, the router asks without this filter.
            # A queue of its own is two or more waiting, as for growth: one is a request
            # caught between its arrival and the engine's next step, and taking that for
            # an overshoot moved x-session-id sessions between engines on an idle pool.
            return False
        if self._kv_tok > 0.0 and now < st.load.batch_next and not self._any_turn:
            return False
        load.limit = ep.limit
        # With this lease on it, as the pool's number counts the next grant.
        load.inflight = ep.inflight + 1
        if self._kv_tok > 0.0:
            load.bind_work(self._kv_tok, now, 1.0)
        ok = adm._endpoint_sat(self._ps, load, now, self.band_index) <= ceiling
        load.inflight = ep.inflight
        if self._kv_tok > 0.0:
            load.bind_work(self._kv_tok, now, -1.0)
        return ok

    cpdef bint skip_turn(self) except -1:
        """The pick found no engine with room for this lease: True when it was batch work
        waiting for an engine's turn (``batch_next``), which from now on it may take early
        (ask the pick again); False when turns were not what held it. The pool granted it
        at all its engines' rates together (``_space_batch``), so it is not early for the
        pool: its engines' turns only fell apart from the pool's. Without this the pick
        fell back to any engine below its limit, past the band's ceiling: a flood's low
        work filled a whole engine that kept its starting limit while another probed, and
        high work then had only the probe's overshoot to wait behind."""
        if self._kv_tok > 0.0 and not self._any_turn:
            self._any_turn = True
            return True
        return False

    cpdef first_byte(self):
        """The first byte of the response came back (time-to-first-token)."""
        if not self.first_byte_at and not self.done:
            self.first_byte_at = self._adm._now()
            if self.endpoint is not None:
                self._st.est.observe_first_byte(self.first_byte_at - self.bound_at - self.handover_s)
                # The pool's too: a gateway under its first long streams can already predict.
                self._ps.est.observe_first_byte(self.first_byte_at - self.bound_at - self.handover_s)

    cpdef handed_over(self):
        """The bound engine's own part starts now (P/D: the decode leg is sent, after the
        prefill leg that ran on another engine): its time to first byte and its service,
        which its estimates learn and its limit is judged by, count from here. The prefill
        leg owns the time before (gateway/pd.pyx)."""
        if self.endpoint is not None and not self.done and not self.first_byte_at:
            self.handover_s = self._adm._now() - self.bound_at

    cpdef usage(self, double prompt, double cached, double completion):
        """What the engine served this request (its ``usage``: prompt tokens, the cached
        part of them, completion tokens), told before ``release``: token fairness then
        settles the tenant's counter from the estimate charged at dispatch to this."""
        cdef Admission adm = self._adm
        if self.done:
            return
        if cached > prompt:
            cached = prompt
        self.fair_actual = prompt - cached + cached * adm.cached_weight + completion * adm.output_weight
        self.fair_known = True

    cpdef release(self, str outcome="completed", error_text=None, long tokens=0):
        """End the lease with one terminal outcome (idempotent)."""
        if self.done:
            return
        cdef int o = outcome_code(outcome)
        self.done = True
        self._adm._on_release(self, o, error_text, tokens)

    def __repr__(self):
        ep = getattr(self.endpoint, "name", None)
        return f"<Lease band={self.band} endpoint={ep} done={self.done}>"


# -- the controller's request path ----------------------------------------------------------

cdef class Admission:
    """Whether and when each request runs. See docs/internals.md ("Admission").

    The request path (``admit_nowait``, ``withdraw``, ``has_room``, the dispatch
    cycle, the lease's bind and release) is typed C; what runs rarely or per scrape
    is plain ``def`` methods.

    ``settings``: AdmissionSettings, or the top-level Settings (converted);
    ``pools``: model name -> Pool (shared with the router, may change);
    ``policy``: "static" | "dynamic" | "smart" or a Policy object;
    ``registry``: a metrics Registry (a private one when None).
    """

    def __init__(self, settings, pools: dict, policy: str | Policy = "dynamic", registry=None,
                 clock=time.monotonic) -> None:
        weights = {t.name: t.weight for t in getattr(settings, "tenants", None) or ()}
        if not isinstance(settings, AdmissionSettings):
            settings = AdmissionSettings.from_settings(settings)
        self.settings = settings.validate()
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, self.settings, weights)
        self.pools = pools
        self.clock = clock
        self.band_names = [b.name for b in self.policy.bands]
        self._ceilings = [b.ceiling for b in self.policy.bands]
        self._band_of = {n: i for i, n in enumerate(self.band_names)}
        self._default_band = self._band_of.get(self.settings.default_band, len(self.band_names) // 2)
        self._pools = {}  # model -> PoolState
        self._eps = {}  # id(endpoint) -> EndpointState
        self._tick = None  # the housekeeping timer while anything is queued
        self._in_flight = 0
        self.telemetry = Telemetry(registry, self.band_names, self.settings.latency_window,
                                   self._depth_samples, self._saturation_samples, self._limit_samples,
                                   self._inflight_samples)
        reg = self.telemetry.registry
        promise_metric = reuse_metric(reg, reg.counter, "velocity_retry_promises_total",
                                      "Retry-After times come due, by whether a request arriving then would "
                                      "be admitted and meet its SLA (kept) or not (broken).", ("outcome",),
                                      merge=SUM)
        sat = self.policy.saturation
        self._configure(sat.model if type(sat) is EngineSaturation else None, type(sat) is FixedConcurrency)
        self.sla = SlaModel(self._ceilings, self._soft_scales, self.settings.sla_tolerance,
                            self.settings.sla_tolerance_high, promise_metric)
        for model in list(pools):
            self._state_of(model)

    # -- the request path ------------------------------------------------------------

    async def admit(self, ticket: Ticket) -> Lease:
        """Grant a lease now or after a wait; raise Rejected when declined."""
        got = self.admit_nowait(ticket, None)
        if got.__class__ is Lease:
            return got
        item = got
        fut = item.waiter
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.withdraw(ticket, item) and fut.done() and not fut.cancelled() \
                    and fut.exception() is None:
                fut.result().release("cancelled")
            raise

    def on_metrics(self, ep) -> None:
        """A scrape of ``ep`` landed: update saturation, check KV, maybe dispatch."""
        st = self._eps.get(id(ep))
        if st is None or st.ep is not ep:
            return
        now = self.clock()
        if ep.scraped_at != st.load.scraped_at:  # not yet taken by an arrival's refresh
            observe_endpoint(st.load, ep)
        # The batch learned here, for the router's hot-spot guard (0 until it is known).
        ep.running_cap = st.load.capacity if st.load.capacity_known else 0.0
        ps = self._pools.get(ep.model)
        # Pace: the engine decodes slower than the deadline work granted lately needs (a
        # fuller batch decodes each token slower): what runs there now would end late.
        slow = observe_pace(ps.pace if ps is not None else None, st.pace, ep.pace, ep.pace_batch,
                            ps.seen if ps is not None else None, now)
        if st.aimd is not None and (ep.kv_usage > self.settings.kv_hard_limit or slow):
            # One cut per staleness window: a full cache stays full for a few scrapes.
            if st.aimd.on_breach(now - self.settings.stale_after_ms / 1000.0, now):
                _set_limit(ep, st.aimd.limit)
                if slow:
                    self.pace_cuts += 1
        elif (st.aimd is not None and not st.load.capacity_known and ep.waiting == 0 and ps is not None
              and not st.pace.high
              and ps.queues.count and ep.inflight + 1 >= math.floor(ep.limit * self.sla.held_share(ps.queues, False))
              and _in_turn(ps, st, now, self.settings.stale_after_ms / 1000.0)):
            # Slow start: the engine runs all it was sent and work waits on this limit.
            if st.aimd.on_probe(now):
                _set_limit(ep, st.aimd.limit)
        if ep.inflight > 0 or ep.running > 0.0 or ep.waiting > 0.0 or st.busy_at == -INFINITY:
            st.busy_at = now  # (the first scrape starts the idle count)
        elif st.aimd is not None and now - st.busy_at >= VF_IDLE_RESET_S and st.aimd.on_idle(now):
            # Idle a while: what cut the limit is over (aimd.pyx, on_idle).
            _set_limit(ep, st.aimd.limit)
        if ps is not None:
            self._cycle(ps, now, True)

    # -- out of memory ---------------------------------------------------------------

    def _on_oom(self, ps: PoolState, st: EndpointState, now: float) -> None:
        st.aimd.on_oom(now)
        _set_limit(st.ep, st.aimd.limit)
        if not self.policy.oom_throttle:
            return
        ps.overload_until = max(ps.overload_until, st.aimd.frozen_until)
        retry = max(1, math.ceil(ps.overload_until - now))
        log.warning("engine %s ran out of memory: limit %d, shedding non-high work for %.1fs",
                    getattr(st.ep, "name", "?"), st.aimd.limit, ps.overload_until - now)
        cdef PoolState pool = ps
        shed = [it for it in pool.queues if it.band > 0]
        for it in shed:
            # (Admission's items are not indexed by id: removed as themselves, not by cancel.)
            pool.queues.remove(it)
            _unqueue(pool, it)
            self._fail_waiter(it, 503, "overload", "an engine ran out of memory; shedding non-high work", retry)
        if shed and pool.shm != NULL:
            _publish(pool)

    # -- housekeeping ----------------------------------------------------------------

    def _on_tick(self) -> None:
        self._tick = None
        try:
            self.housekeep()
        except Exception:
            log.exception("admission housekeeping failed")
        if self._queued() or any(ps.work.promises for ps in self._pools.values()):
            self._arm()

    def housekeep(self) -> None:
        """Judge the Retry-After promises come due, expire TTLs, decline hopeless
        requests, then dispatch (aging)."""
        now = self.clock()
        for ps in self._pools.values():
            if ps.work.promises:
                self._settle_promises(ps, now)
            q = ps.queues
            if q.count == 0:
                continue
            for it in q.expire(now):
                _unqueue(ps, it)
                self._fail_waiter(it, 504, "ttl", "waited in the queue past its TTL", None)
            if self.policy.drop_hopeless and q.count:
                self._drop_hopeless(ps, now)
            self._cycle(ps, now, True)

    def _drop_hopeless(self, PoolState ps, double now) -> None:
        cdef ServiceEstimate est = ps.est
        if not est.tpot.seen:
            return
        # Only the best case counts (no queue wait): what is dropped here could not have
        # made it under any schedule. The pool's own estimate by size: a first token by
        # the line learned from streams (none from whole answers), then each token.
        base = est.first_token(0.0) if est.streams else 0.0
        tpot = est.tpot.value
        for it in ps.queues.pop_hopeless(now, base, tpot):
            _unqueue(ps, it)
            self._fail_waiter(it, 429, "sla", "can no longer meet its SLA",
                              self._promise(ps, it.band, it.service, it.grant_deadline - it.enqueued_at, now))

    def _fail_waiter(self, item, status: int, reason: str, message: str, retry_after) -> None:
        fut = item.waiter
        rej = self._reject(status, reason, message, retry_after)
        if not fut.done():
            fut.set_exception(rej)

    def close(self) -> None:
        """Stop the housekeeping timer and fail whatever still waits (503)."""
        cdef PoolState ps
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        for ps in self._pools.values():
            ps.work.promises.clear()
            for it in list(ps.queues):
                ps.queues.remove(it)
                _unqueue(ps, it)
                self._fail_waiter(it, 503, "no-endpoint", "the gateway is shutting down", 1)

    # -- visibility ------------------------------------------------------------------

    def _depth_samples(self):
        depth = [0] * len(self.band_names)
        for ps in self._pools.values():
            for i in range(len(depth)):
                depth[i] += ps.queues.band(i).count
        return [((n,), d) for n, d in zip(self.band_names, depth)]

    def known_pools(self) -> dict[str, PoolState]:
        """Every pool's state, created for pools no request has asked for yet: the
        gateway adds its endpoints after building admission, and /stats and the
        metrics must show their limits before the first request."""
        for model in list(self.pools):
            if model not in self._pools:
                self._state_of(model)
        return self._pools

    def _saturation_samples(self):
        now = self.clock()
        out = []
        for model, ps in self.known_pools().items():
            self._refresh(ps)
            out.append(((model,), min(self.policy.saturation.pool(ps.loads, ps.pending, now), 1e9)))
        return out

    def _limit_samples(self):
        return [((st.ep.name,), st.ep.limit) for st in self._eps.values()]

    def _inflight_samples(self):
        return [((st.ep.name,), st.ep.inflight) for st in self._eps.values()]

    def stats(self) -> dict:
        """Scheduler statistics for /stats."""
        now = self.clock()
        tel = self.telemetry
        counts = tel.counts()
        counts["in_flight"] = self._in_flight
        bands = {}
        for i, name in enumerate(self.band_names):
            depth = nbytes = 0
            oldest = None
            for ps in self._pools.values():
                b = ps.queues.band(i)
                depth += b.count
                nbytes += b.nbytes
                if b.oldest_enqueued_at is not None:
                    oldest = b.oldest_enqueued_at if oldest is None else min(oldest, b.oldest_enqueued_at)
            ceiling = self._ceilings[i]
            bands[name] = {"depth": depth, "bytes": nbytes,
                           "ceiling": ceiling if math.isfinite(ceiling) else None,
                           "oldest_wait_ms": None if oldest is None else round((now - oldest) * 1000.0, 3),
                           "wait_ms": percentiles(tel.waits[i])}
        pools = {}
        batch = -1  # the lowest band paced as batch work (a soft ceiling under its ceiling)
        for i in range(len(self.band_names) - 1, -1, -1):
            if self._soft_scales[i] > 1.0:
                batch = i
                break
        for model, ps in self.known_pools().items():
            self._refresh(ps)
            sat = self.policy.saturation.pool(ps.loads, ps.pending, now)
            need = need_now(ps.pace, now)
            pools[model] = {"saturation": None if math.isinf(sat) else round(sat, 4), "queued": ps.queues.count,
                            "pending_leases": ps.pending,
                            # The tightest pace (ms a token) the deadline work granted lately needs.
                            "pace_need_ms": None if need == INFINITY else round(need * 1000.0, 3),
                            # The output tokens a request that names no max tokens is taken
                            # for, learned from the pool's answers to such requests.
                            "open_tokens": {"chat": ps.open_chat.snapshot(),
                                            "completions": ps.open_text.snapshot()},
                            "overload_s": round(max(0.0, ps.overload_until - now), 3),
                            # Whether batch work's projected KV peak may pass its share of
                            # the cache now (no band the cache holds back has asked lately:
                            # _peak_cap); None where no band is paced as batch work.
                            "batch_peak_past_share": None if batch < 0 else self._peak_cap(ps, batch, now) > 0.0}
        endpoints = {}
        for st in self._eps.values():
            ep = st.ep
            endpoints[ep.name] = {
                "limit": ep.limit, "inflight": ep.inflight,
                # Other gateways' work on this engine as the last scrape showed it (replicas).
                "others": st.load.others,
                "saturation": round(self.policy.saturation.endpoint(st.load, now), 4),
                # The engine's batch once learned (None: not yet shown), and the most seen running.
                "batch_capacity": st.load.capacity if st.load.capacity_known else None,
                "kv_ahead": round(st.load.kv_ahead(now), 4),
                "kv_peak": round(st.load.kv_peak(), 4),
                "kv_fixed": round(st.load.kv_fixed, 1),
                "running_max": st.load.capacity,
                "frozen": bool(st.aimd is not None and st.aimd.frozen(now)),
                # The engine's decode pace over the last second (ms a token; None: unknown).
                "pace_ms": round(ep.pace * 1000.0, 3) if ep.pace > 0.0 else None,
                # Its pace running one sequence at most, the best a limit can give (None: not seen).
                "solo_pace_ms": round(st.pace.solo * 1000.0, 3) if st.pace.solo > 0.0 else None,
                "estimates": st.est.snapshot()}
        judged = tel.sla_met + tel.sla_missed
        return {
            "policy": self.policy.name,
            "counters": counts,
            "queued": self._queued(),
            "queue_cancelled": tel.queue_cancelled,
            "rejections": dict(tel.reasons),
            "bands": bands,
            "pools": pools,
            "limits": {name: e["limit"] for name, e in endpoints.items()},
            "endpoints": endpoints,
            "sla": {"met": tel.sla_met, "missed": tel.sla_missed,
                    "compliance": round(tel.sla_met / judged, 4) if judged else None},
            # Retry-After times told (made), and of those come due, whether a request
            # arriving then would have been admitted within its SLA (kept) or not (broken).
            "retry_promises": dict(self.sla.promise_counts),
            # Limits cut because an engine decoded slower than the deadline work needs.
            "pace_cuts": self.pace_cuts,
            "latency_ms": {"e2e": percentiles(tel.e2e), "ttft": percentiles(tel.ttfts)},
        }


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
        # A band's own SLA over the server's; 0: no deadline at all.
        self._band_sla = [self._sla_s if b.sla_ms is None else (INFINITY if b.sla_ms == 0 else b.sla_ms / 1000.0)
                          for b in p.bands]
        self._soft_scales = [b.ceiling / b.soft_ceiling if b.soft_ceiling and math.isfinite(b.ceiling) else 1.0
                           for b in p.bands]
        # Where the dispatch cycle must count a band's own saturation (a bit a band: the
        # cycle reads it as C; bands past 63 always count their own).
        self._soft_breaks = 0
        for i in range(1, len(p.bands)):
            if i > 63 or self._soft_scales[i] != self._soft_scales[i - 1]:
                self._soft_breaks |= (<unsigned long long>1) << (i if i < 63 else 63)
        # Borrowing: the lowest bands, each with no deadline and a ceiling below 1, fill
        # all of a known batch but a slot while no higher band has asked for a while
        # (``_ceiling``). Not with one band (nothing above to keep room for), nor where
        # saturation is not the engines' (fixed concurrency, a policy's own).
        nb = len(p.bands)
        # The bands the KV term can hold back (a ceiling under 1 / kv_threshold: normal's
        # 1.0 stops at 0.8 of the cache, high's 1.5 never), other than batch work itself:
        # while none has asked for admission.borrow_after_ms, batch work's projected cache
        # may pass its share up to the engine's margin (_peak_cap).
        self._held_bands = [math.isfinite(b.ceiling) and b.ceiling * s.kv_threshold < 1.0
                            and self._soft_scales[i] <= 1.0 for i, b in enumerate(p.bands)]
        self._borrow_from = nb
        self._borrow_after = s.borrow_after_ms / 1000.0
        if sat_model is not None and s.borrow_after_ms > 0:
            for i in range(nb - 1, 0, -1):
                if self._band_sla[i] == INFINITY and p.bands[i].ceiling < 1.0:
                    self._borrow_from = i
                else:
                    break
        self._global_capacity = s.global_capacity or 0
        self._kv_hard_limit = s.kv_hard_limit
        self._ttft_slo_ms = s.ttft_slo_ms
        self._tick_s = s.tick_ms / 1000.0
        self._oom_throttle = p.oom_throttle
        self._sla_reject = p.sla_reject
        self._adaptive = p.adaptive
        self.output_weight = s.fairness_output_weight
        self.cached_weight = s.fairness_cached_weight
        self.settle_usage = p.counts_tokens and s.fairness_charge == "actual"

    cdef void set_waiter(self, type kind, waiting_fn waiting, granted_fn granted) noexcept:
        """Drive waiters of class ``kind`` (the gateway's exchange) as C: ``waiting(w)`` is
        True while it still waits; ``granted(w, lease)`` schedules its work. Set by whoever
        builds this Admission (gateway/assemble.py), before its first request."""
        self._waiter_type, self._c_waiting, self._c_granted = kind, waiting, granted

    cdef void set_locality(self, locality_fn fn) except *:
        """How a queued request's prefix stands (``fn(waiter)``: the fraction of its prompt
        an engine with room holds), for the bands whose tenants go by locality; told to
        every pool's queues, those made later too. Set by whoever builds this Admission."""
        cdef PoolState ps
        self._locality = fn
        for ps in self._pools.values():
            ps.queues.locality = fn

    cdef inline bint _waiting(self, waiter) except -1:
        """A queued request's waiter still waits: one of the class set asked as C, a
        future as a future."""
        if type(waiter) is self._waiter_type:
            return self._c_waiting(waiter)
        return not waiter.done()

    cdef double _now(self) except? -1.0:
        if self._mono:
            return event_now()
        return self.clock()

    cdef double _pool_sat(self, PoolState ps, double now, int band) except? -1.0:
        """The pool's saturation once one more request of ``band`` is granted: the band may
        grant it while this stays within its ceiling. Counting the grant itself, not the
        state before it, makes a ceiling below 1 keep at least one slot of every engine for
        higher bands, whatever the engine's batch (0.95 of 8 leaves one, as of 64 it leaves
        four). What is only guessed of an engine is held to the band's soft ceiling
        (saturation.pyx: its KV, and its limit while its batch is not learned)."""
        cdef EndpointLoad e
        cdef bint idle
        if self._sat is not None:
            if self._soft_scales[band] > 1.0 and now < ps.batch_next:
                return INFINITY  # batch work: no engine's turn yet (_space_batch)
            if ps.pending == 0:
                # Work-conserving: an idle pool grants one whatever the band's ceilings (a
                # ceiling below 1/limit would otherwise hold a band back with nothing running).
                # Idle: nothing of ours in flight, and no fresh scrape shows others' work, a
                # queue or a KV cache past its threshold.
                idle = False
                for e in ps.loads:
                    if not e.healthy:
                        continue
                    if e.inflight or (now - e.scraped_at <= self._sat.stale_after
                                      and (e.others > 0.0 or e.waiting > 0.0
                                           or e.kv >= self._sat.kv_threshold)):
                        idle = False
                        break
                    idle = True
                if idle:
                    return 0.0
            # The grant's own tokens counted too (as the lease's has_room counts them at the
            # pick), expected as the last batch grant's.
            return self._sat.pool(ps.loads, ps.pending + 1, now, <double>self._soft_scales[band],
                                  ps.pending_tokens + (ps.last_kv_tok if self._soft_scales[band] > 1.0 else 0.0),
                                  self._peak_cap(ps, band, now))
        if self._fixed:
            for e in ps.loads:
                if e.healthy:
                    return 0.0
            return INFINITY
        return self._sat_obj.pool(ps.loads, ps.pending + 1, now)

    cdef double _endpoint_sat(self, PoolState ps, EndpointLoad load, double now, int band) except? -1.0:
        if self._sat is not None:
            return self._sat.endpoint(load, now, 0.0, <double>self._soft_scales[band], 0.0,
                                      self._peak_cap(ps, band, now))
        if self._fixed:
            return 0.0
        return self._sat_obj.endpoint(load, now)

    cdef double _peak_cap(self, PoolState ps, int band, double now) noexcept:
        """1.0 where batch work's projected cache may pass its band's share of it up to the
        engine's margin (95 %), 0 where the share holds (Saturation.endpoint's peak_cap).
        The pace still aims batch work at its share (_space_batch): held at the same share
        as the pace aims at, work bound just before a wave of answers ends passed it, so
        the next wave began where the last ended and the cache swung between a quarter and
        three quarters full. What the share keeps free is for the bands the cache can hold
        back (``_held_bands``: normal, which stops at 0.8 of it); high is never held back
        by the cache and needs only the blocks of its own short requests, which the margin
        keeps. So the peak may pass the share while none of those has asked in the pool for
        admission.borrow_after_ms, and only where this gateway sees all the work: not
        across workers, nor beside another replica's work (as _borrowed)."""
        cdef EndpointLoad e
        if (self._soft_scales[band] <= 1.0 or self._borrow_after <= 0.0 or ps.shm != NULL
                or now - ps.held_at < self._borrow_after or self._sat is None):
            return 0.0
        for e in ps.loads:
            if e.healthy and e.others > 0.0 and now - e.scraped_at <= self._sat.stale_after:
                return 0.0
        return 1.0

    cdef double _ceiling(self, PoolState ps, int band, double now) except? -1.0:
        """``band``'s ceiling in ``ps`` now: its own, or what it borrows (``_borrowed``)
        when it is a deadline-free band and no higher band has asked in the pool for
        ``admission.borrow_after_ms``. Batch work alone then runs the engines nearly full; the first
        higher request finds a slot free on every engine, and its arrival ends the
        borrowing: no more low work is granted until low is back under its ceiling."""
        cdef double c = <double>self._ceilings[band]
        if band < self._borrow_from or ps.shm != NULL or now - ps.higher_at < self._borrow_after:
            return c
        return _borrowed(ps, now, self._sat.stale_after, c)

    # -- arrival ----------------------------------------------------------------------------

    cpdef object admit_nowait(self, Ticket ticket, waiter):
        """Grant a lease now, raise Rejected, or queue ``waiter`` and return its queue Item
        (``item.waiter`` is the waiter).

        ``waiter`` is a future or any object with ``done()``, ``set_result(lease)`` and
        ``set_exception(rejected)`` (called from the dispatch cycle: it must only
        schedule its work); None queues a new future. ``withdraw`` takes it back.
        """
        cdef double now = self._now()
        cdef PoolState ps = self._pools.get(ticket.model)
        cdef int band
        cdef double deadline, budget, sat, service
        cdef long room, cap
        cdef long long rid
        cdef Item item
        cdef BandQueues q
        cdef Lease lease
        if ps is None:
            ps = self._state_of(ticket.model)
        if ps is None or not self._refresh(ps):
            raise self._reject(503, "no-endpoint", "no healthy endpoint serves this model", 1)
        # No band name, or an unknown one: the default band (one band: its index 0 is
        # both the only name's and the default's).
        name = ticket.band
        band = self._band_of.get(name, self._default_band) if name else self._default_band
        if band < self._borrow_from:
            ps.higher_at = now
        if self._held_bands[band]:
            ps.held_at = now
        if self._oom_throttle and band > 0 and now < ps.overload_until:
            raise self._reject(503, "overload", "an engine ran out of memory; shedding non-high work",
                               max(1, <long>ceil(ps.overload_until - now)))
        # The SLA: the request's own (or its tenant's, filled in by the gateway), else its
        # band's, else the server's. Each is a real deadline: predicted, declined early,
        # judged. A band may have none (INFINITY): its work is never declined on a prediction.
        sla_ms = ticket.sla_ms
        budget = <double>sla_ms / 1000.0 if sla_ms is not None and sla_ms > 0 else <double>self._band_sla[band]
        deadline = now + budget
        # Its expected service by its size (-1: nothing learned yet).
        service = ps.est.expect_size(<double>ticket.prompt_bytes, ticket.max_tokens)
        q = ps.queues
        # Free slots on the pool's endpoints: nothing below binds or frees one, so the
        # count holds until this call returns.
        room = free_slots(ps.seen, ps.pending)
        # Nothing queued at or above this band: no one to overtake, go at once. A request
        # that goes at once is never declined on a prediction (an idle pool is the
        # plainest case): no wait of the gateway's making stands between it and its SLA.
        sat = -1.0
        if (q.count == 0 or q.count_through(band) == 0) and room > 0 and (ps.shm == NULL or
                                                                         not _others_queued(ps, band)):
            sat = self._pool_sat(ps, now, band)
            if sat <= self._ceiling(ps, band, now) and sat != INFINITY and (ps.shm == NULL or _reserve(ps)):
                lease = self._grant(ps, band, ticket.tenant, ticket.max_tokens, ticket.prompt_bytes, service,
                                    deadline, now, now)
                if q.counted(band):  # dispatched without queueing: charged all the same
                    lease.fair_charged = q.estimate(ticket.prompt_bytes, ticket.max_tokens)
                    lease._fair_t = q.charge(band, ticket.tenant, lease.fair_charged)
                return lease
        if self._sla_reject and budget != INFINITY:
            self._check_sla(ps, band, service, budget, room, sat, now)
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
                      now + budget * (1.0 + self.sla.tolerance(band)), now, &rid)
        if item is None:
            what = "band" if rid in (REJECT_BAND_COUNT, REJECT_BAND_BYTES) else "admission"
            raise self._reject(503, "capacity", f"{what} queue is full ({self.band_names[band]})", 1)
        # What the grant needs rides with the item, as worked out here (the same
        # deadline from the same arrival time).
        item.grant_deadline = deadline
        item.max_tokens = ticket.max_tokens
        item.service = service
        if service > 0.0:
            ps.work.queued_work += service
        if room > 0:  # else the cycle would stop at once (the pool was just refreshed)
            self._cycle(ps, now, True)
        elif ps.shm != NULL:
            _publish(ps)
        # Under load the tick is already armed: no need to ask the waiter.
        if self._tick is None and self._waiting(waiter):
            self._arm()
        return item

    cpdef bint withdraw(self, Ticket ticket, Item item) except -1:
        """Take a queued request out of its queue (its client left); False if no longer queued."""
        cdef PoolState ps
        if item is None:
            return False
        ps = self._state_of(ticket.model)
        if ps is None or not ps.queues.holds(item):
            return False
        ps.queues.remove(item)
        _unqueue(ps, item)
        if ps.shm != NULL:
            _publish(ps)
        self.telemetry.queue_cancelled += 1
        return True

    cdef long _free_for(self, PoolState ps, int band, long room, double sat, double now) except -1:
        """The slots of the pool's ``room`` a request of ``band`` arriving now may take at
        once: none when the pool's saturation (``sat``, counted here when < 0) is past the
        band's ceiling, whose room is kept for higher bands."""
        if room <= 0:
            return 0
        if sat < 0.0:
            sat = self._pool_sat(ps, now, band)
        return room if sat <= <double>self._ceilings[band] else 0

    cdef void _check_sla(self, PoolState ps, int band, double service, double budget, long room, double sat,
                         double now) except *:
        """A request that cannot go at once: raise Rejected (429 ``sla``) when its
        predicted completion, the queue wait ahead of it (sla.pyx) plus its own service,
        passes its SLA (with the band's tolerance). Unknown estimates predict nothing: a
        cold gateway never declines on a guess."""
        cdef double predicted
        if service < 0.0:
            return
        predicted = self.sla.wait(ps.work, ps.seen, ps.loads, band, self._free_for(ps, band, room, sat, now),
                                  now) + service
        if predicted > budget * (1.0 + self.sla.tolerance(band)):
            raise self._reject(
                429, "sla", f"predicted completion {predicted * 1000:.0f} ms exceeds the SLA of "
                f"{budget * 1000:.0f} ms", self._promise(ps, band, service, budget, now))

    # -- Retry-After: a time that keeps its promise (sla.pyx) --------------------------------

    def _promise(self, PoolState ps, int band, double service, double budget, double now):
        """When a declined request of ``band`` (own service ``service``, SLA ``budget``)
        should come back, in seconds from now (SlaModel.promise), after the promises come
        due are judged; the tick judges this one when it comes due."""
        cdef bint booked = False
        cdef double s
        self._settle_promises(ps, now)
        s = self.sla.promise(ps.work, ps.seen, ps.loads, band, service, budget, now, &booked)
        if booked:
            self._arm()
        return s

    def _settle_promises(self, PoolState ps, double now):
        """Judge the promises come due: would a request of the promised band and size,
        arriving now, be admitted and meet its SLA? Kept or broken."""
        cdef double service = 0.0, budget = 0.0, sat
        cdef long room
        cdef int band = 0
        cdef bint kept
        cdef SlaModel sla = self.sla
        while sla.next_due(ps.work, now, &service, &band, &budget):
            kept = True
            if self._refresh(ps):
                room = free_slots(ps.seen, ps.pending)
                sat = self._pool_sat(ps, now, band) if room > 0 else -1.0
                if not (ps.queues.count_through(band) == 0 and room > 0 and sat <= <double>self._ceilings[band]):
                    kept = (sla.wait(ps.work, ps.seen, ps.loads, band, self._free_for(ps, band, room, sat, now), now)
                            + service <= budget * (1.0 + sla.tolerance(band)))
            sla.judged(kept)

    @property
    def promise_counts(self):
        """Retry-After times told (``made``) and, of those come due, ``kept`` and ``broken``."""
        return self.sla.promise_counts

    cpdef OutputEstimate open_estimate(self, model, bint chat):
        """The output tokens estimate of ``model``'s pool (None: the default pool) for a
        request that names no max tokens, chat or /v1/completions; None: no such pool. The
        gateway takes such a request for ``expect()`` tokens and teaches it the answer's."""
        cdef PoolState ps = self._pools.get(model)
        if ps is None:
            ps = self._state_of(model)
            if ps is None:
                return None
        return ps.open_chat if chat else ps.open_text

    def prediction(self, model=None, band=None, long max_tokens=16, long prompt_bytes=0):
        """``(wait_s, service_s)`` that the SLA check would predict for a request of
        ``band`` (name; None: the default), ``prompt_bytes`` and ``max_tokens`` arriving
        now in ``model``'s pool (None: the default pool); None while nothing is known."""
        cdef PoolState ps = self._state_of(model)
        cdef int b = self._band_of.get(band, self._default_band) if band else self._default_band
        cdef double service, now
        if ps is None or not self._refresh(ps):
            return None
        service = ps.est.expect_size(<double>prompt_bytes, max_tokens)
        if service < 0.0:
            return None
        now = self._now()
        return (self.sla.wait(ps.work, ps.seen, ps.loads, b,
                              self._free_for(ps, b, free_slots(ps.seen, ps.pending), -1.0, now), now), service)

    def has_room(self, Endpoint ep):
        """True when ``ep`` may take one more request now, of any band (the router's
        filter once a lease's own band found none: ``Lease.has_room``)."""
        if ep.shm != NULL:
            sync_shared(ep, None)
        return ep.healthy and ep.inflight < ep.limit

    def _reject(self, int status, str reason, str message, retry_after):
        self.telemetry.reject(reason)
        return Rejected(status, reason, message, retry_after)

    # -- pools and endpoints ------------------------------------------------------------------

    cdef PoolState _state_of(self, model):
        """The state of ``model``'s pool (None: the default pool), made on first use;
        None when there is no such pool. A pool once known keeps its state even after
        it left ``pools`` (its queue may still hold requests): a look-up in ``_pools``
        is this method's answer when it finds one."""
        pools = self.pools
        if model is None or model not in pools:
            if model is not None and model in self._pools:
                return self._pools[model]
            model = next(iter(pools), None) if model is None else model
            if model is None or model not in pools:
                return None
        ps = self._pools.get(model)
        if ps is None:
            ps = self._pools[model] = PoolState(pools[model], self.policy.make_queues(self.settings),
                                                self.settings.ewma_alpha)
            (<PoolState>ps).queues.locality = self._locality
            (<PoolState>ps).shm = pool_slot(model)
        return ps

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

    cdef bint _refresh(self, PoolState ps) except -1:
        """Refresh the compiled loads from the endpoints; True if any is healthy."""
        cdef EndpointState st
        cdef list eps = lease_endpoints(ps.pool)
        # The pool has not changed since the last cycle: the same endpoints.
        if not same_endpoints(ps.seen, eps):
            ps.states = [self._ep_state(e) for e in eps]
            ps.loads = [st.load for st in ps.states]
            ps.pace.endpoints = [st.pace for st in ps.states]
            ps.seen = list(eps)
        return refresh(ps.loads, ps.seen)

    def queued(self):
        """Requests waiting in admission, every pool and band."""
        return self._queued()

    cdef long _queued(self) except -1:
        cdef PoolState ps
        cdef long n = 0
        for ps in self._pools.values():
            n += ps.queues.count
        return n

    # -- the dispatch cycle -------------------------------------------------------------------

    cdef void _cycle(self, PoolState ps, double now, bint have_now) except *:
        """One dispatch cycle for ``ps``; ``now``: the caller's own reading of the clock,
        when it has just taken one (``have_now``: the cycle runs at the moment of what
        triggered it)."""
        if ps.shm == NULL:
            self._cycle_run(ps, now, have_now)
            return
        try:
            self._cycle_run(ps, now, have_now)
        finally:
            if ps.spare:  # a reservation made for an item that was no longer waiting
                ps.spare = False
                unreserve(ps.shm)
            _publish(ps)

    cdef void _cycle_run(self, PoolState ps, double now, bint have_now) except *:
        cdef BandQueues q = ps.queues
        cdef long room
        cdef bint healthy, have_sat = False
        cdef double sat = 0.0, ceiling, service
        cdef int band, nbands
        cdef Item item
        if q.count == 0:
            return
        # No room on the endpoints already known: nothing can go whatever the loads
        # say (most calls under full load), so their refresh is skipped. A pool whose
        # endpoints changed is refreshed first: a new endpoint may bring the room. The
        # same pool needs only its loads refreshed, which reads the endpoints without
        # changing them: the room counted before still holds.
        if same_endpoints(ps.seen, lease_endpoints(ps.pool)):
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
            ceiling = self._ceiling(ps, band, now)
            if band and (self._soft_breaks >> (band if band < 63 else 63)) & 1:
                have_sat = False  # this band's soft ceiling differs: its own number
            while True:
                if room <= 0:
                    return
                if not have_sat:
                    sat = self._pool_sat(ps, now, band)
                    have_sat = True
                if sat > ceiling or sat == INFINITY:
                    return
                if ps.shm != NULL:
                    # Workers: a higher band queued in another worker goes first (it
                    # takes the room at its next cycle); a lease is reserved across them.
                    if _others_queued(ps, band - 1) or _older_elsewhere(ps, band):
                        return
                    if not ps.spare:
                        if not _reserve(ps):
                            return
                        ps.spare = True
                # Batch work aged up into this band is still batch work: granted at its
                # pace and with its tokens counted (_pool_sat for its own band, against
                # this band's ceiling). While it may not go, the band's own items do.
                held = False
                if q.aging_step > 0.0 and self._soft_scales[band] <= 1.0:
                    aged = q.aged_head(band, now)
                    held = (aged is not None and self._soft_scales[(<Item>aged).band] > 1.0
                            and self._pool_sat(ps, now, (<Item>aged).band) > ceiling)
                item = q.pop_own(band) if held else q.pop(band, now)
                if item is None:
                    break
                _unqueue(ps, item)
                fut = item.waiter
                if not self._waiting(fut):
                    if item.charged_to is not None:  # charged at the pop, never served
                        q.settle(item.charged_to, item.charged, 0.0)
                    continue
                # Learned since it was queued, or grown slower: one that cannot finish by
                # its deadline from now is declined, not admitted to miss it.
                service = item.service
                if service < 0.0:  # nothing was known when it was queued: what is known now
                    service = ps.est.expect_size(<double>item.nbytes, item.max_tokens)
                if self._sla_reject and service > 0.0 and now + service > item.deadline:
                    if item.charged_to is not None:
                        q.settle(item.charged_to, item.charged, 0.0)
                    self._fail_waiter(item, 429, "sla", "can no longer meet its SLA",
                                      self._promise(ps, item.band, service,
                                                    item.grant_deadline - item.enqueued_at, now))
                    continue
                room -= 1
                have_sat = False
                ps.spare = False
                lease = self._grant(ps, item.band, item.tenant, item.max_tokens, item.nbytes, service,
                                    item.grant_deadline, item.enqueued_at, now)
                if item.charged_to is not None:  # token fairness: for the settlement
                    (<Lease>lease)._fair_t = item.charged_to
                    (<Lease>lease).fair_charged = item.charged
                if type(fut) is self._waiter_type:
                    self._c_granted(fut, lease)
                else:
                    fut.set_result(lease)

    cdef Lease _grant(self, PoolState ps, int band, tenant, long max_tokens, long prompt_bytes, double service,
                      double deadline, double arrived_at, double now):
        cdef Lease lease = Lease.__new__(Lease)
        ps.pending += 1
        # The KV batch work will still decode counts against every band (kv_ahead): work
        # with a deadline, whose clients often ask far more max_tokens than they use, is
        # not counted in it, nor held back by its own.
        lease._kv_tok = <double>max_tokens if self._soft_scales[band] > 1.0 else 0.0
        ps.pending_tokens += lease._kv_tok
        if lease._kv_tok > 0.0:
            ps.last_kv_tok = lease._kv_tok
            _space_batch(ps, lease._kv_tok, now, VF_KV_PROJECTED * self._ceiling(ps, band, now))
        cdef PoolWork w = ps.work
        # Admitted work: counted by its expected end until it is released.
        if service > 0.0:
            lease.expect_end = now + service
            w.busy_end += lease.expect_end
            w.busy_n += 1
        self._in_flight += 1
        self.telemetry.granted(band, now - arrived_at)
        lease._adm = self
        lease._ps = ps
        lease._reserved = ps.shm != NULL  # (every grant is reserved first when workers share)
        lease.band_index = band
        lease.band = self.band_names[band]
        lease.tenant = tenant
        lease.max_tokens = max_tokens
        lease.prompt_bytes = prompt_bytes
        lease.deadline = deadline
        lease.arrived_at = arrived_at
        lease.granted_at = now
        if deadline != INFINITY and max_tokens > 0:
            # The pace its decoding needs (pace.pyx).
            note_grant(ps.pace, deadline, ps.est.first_token(<double>prompt_bytes), max_tokens, now)
        return lease

    # -- leases -------------------------------------------------------------------------------

    cdef void _on_bind(self, Lease lease, Endpoint ep, bint rebind) except *:
        cdef PoolState ps = lease._ps
        cdef EndpointState st
        if not rebind:
            ps.pending -= 1
            ps.pending_tokens = ps.pending_tokens - lease._kv_tok if ps.pending > 0 else 0.0
        if lease._claimed:  # the slot is taken already (claim)
            lease._claimed = False
            ep.inflight = inflight_total(ep.shm, ep.inflight)
        else:
            ep.inflight = inflight_add(ep.shm, ep.inflight, 1)
        if ep.inflight > ep.inflight_peak:
            ep.inflight_peak = ep.inflight
        # An endpoint admission knows already (the common case) needs no call.
        st = self._known_state(ep)
        lease._st = st if st is not None else self._ep_state(ep)
        if lease._kv_tok > 0.0:
            lease._st.load.bind_work(lease._kv_tok, lease.bound_at, 1.0)
            # At the band's share of the cache, or what it borrows (low work alone).
            _space_engine(lease._st.load, lease._kv_tok, lease.bound_at,
                          VF_KV_PROJECTED * self._ceiling(ps, lease.band_index, lease.bound_at))
        if not rebind and ps.queues.count:
            # Pending leases count in full on every endpoint (saturation.pool): now
            # that this one has a place, the others' headroom is known again. With
            # nothing queued there is nobody to hand it to.
            self._cycle(ps, 0.0, False)

    cdef void _on_unbind(self, Lease lease, Endpoint ep) except *:
        ep.inflight = inflight_add(ep.shm, ep.inflight, -1)
        if lease._st is not None:
            if lease._kv_tok > 0.0:
                lease._st.load.bind_work(lease._kv_tok, lease.bound_at, -1.0)
        self._cycle(lease._ps, 0.0, False)

    cdef void _on_release(self, Lease lease, int outcome, error_text, long tokens) except *:
        cdef double now = self._now()
        cdef PoolState ps = lease._ps
        cdef int sla = -1
        cdef Endpoint ep = lease.endpoint
        self._in_flight -= 1
        if lease._fair_t is not None:
            ps.queues.settle(lease._fair_t, lease.fair_charged,
                             lease.fair_actual if lease.fair_known and self.settle_usage else -1.0)
            lease._fair_t = None  # (the lease is recycled: no queue kept alive by it)
        cdef PoolWork w
        if lease.expect_end > 0.0:
            w = ps.work
            w.busy_n -= 1
            w.busy_end -= lease.expect_end
            if w.busy_n == 0:
                w.busy_end = 0.0  # no drift left behind by the sums
        # Work without a deadline is not judged against one.
        if outcome == COMPLETED and lease.deadline != INFINITY:
            sla = 1 if now <= lease.deadline else 0
        self.telemetry.finished(lease.band_index, outcome, now - lease.arrived_at,
                                lease.first_byte_at - lease.arrived_at if lease.first_byte_at else -1.0, sla)
        if lease._reserved:
            lease._reserved = False
            unreserve(ps.shm)
        if ep is None:
            ps.pending -= 1
            ps.pending_tokens = ps.pending_tokens - lease._kv_tok if ps.pending > 0 else 0.0
        else:
            ep.inflight = inflight_add(ep.shm, ep.inflight, -1)
            if lease._st is not None:
                if lease._kv_tok > 0.0:
                    lease._st.load.bind_work(lease._kv_tok, lease.bound_at, -1.0)
                if outcome == COMPLETED and lease._kv_tok > 0.0:
                    lease._st.load.ended(<double>tokens, <double>lease.max_tokens)
            self._learn(ps, lease, ep, outcome, error_text, tokens, now)
        self._cycle(ps, now, True)

    cdef void _learn(self, PoolState ps, Lease lease, Endpoint ep, int outcome, error_text, long tokens,
                     double now) except *:
        cdef EndpointState st = lease._st
        cdef double engine_ttft = (lease.first_byte_at - lease.bound_at - lease.handover_s
                                   if lease.first_byte_at else -1.0)
        cdef double engine_s = now - lease.bound_at - lease.handover_s
        cdef double expected = -1.0
        cdef long n = tokens if tokens else lease.max_tokens
        cdef AimdLimit aimd
        cdef bint slow, missed, queued
        # What this engine usually takes for such a request, before this sample counts.
        expected = st.est.expect_size(<double>lease.prompt_bytes, n)
        if outcome == COMPLETED:
            st.est.observe(engine_ttft, engine_s, n, <double>lease.prompt_bytes)
            ps.est.observe(engine_ttft, engine_s, n, <double>lease.prompt_bytes)
        aimd = st.aimd
        if aimd is None:
            return
        if error_text and _OOM_TEXT in error_text.lower():
            self._on_oom(ps, st, now)
            return
        if outcome != COMPLETED:
            return
        # Latency is a breach only for work that has a deadline: a limit cut for what only
        # deadline-free work sees would cost its throughput and serve no SLA.
        slow = missed = False
        if lease.deadline != INFINITY:
            slow = engine_ttft >= 0 and engine_ttft * 1000.0 > self._ttft_slo_ms
            # A miss is the engine's doing only if its own part overran the whole budget
            # (time queued in the gateway is not cured by a smaller engine limit) and it
            # was slower than usual: an SLA no engine could meet says nothing of load.
            missed = (engine_s > lease.deadline - lease.arrived_at
                      and expected >= 0 and engine_s > VF_CONGESTION_FACTOR * expected)
        if slow or missed:
            aimd.on_breach(lease.bound_at, now)
        else:
            # Before its batch is learned an engine grows only in its turn (``_in_turn``).
            queued = ps.queues.count > 0 and (st.load.capacity_known or _in_turn(ps, st, now, self.settings.stale_after_ms / 1000.0))
            # Healthy: KV below its hard limit, and no queue of the engine's own (two or
            # more waiting): an engine that queues is held back by itself, not by the limit,
            # and a larger limit only lengthens its FIFO queue, where priorities no longer
            # apply (an engine whose batch is bound by its KV shows it so).
            aimd.on_sample(queued, queued and ep.inflight + 1 >= floor(
                ep.limit * self.sla.held_share(ps.queues, st.load.capacity_known)),
                           st.load.kv <= self._kv_hard_limit and st.load.waiting < 2.0 and not st.pace.high, now)
        _set_limit(ep, <int>aimd.value)

    # -- housekeeping -------------------------------------------------------------------------

    cdef void _arm(self) except *:
        if self._tick is None:
            self._tick = get_running_loop().call_later(self._tick_s, self._on_tick)
