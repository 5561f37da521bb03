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
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from .._core.aimd import AimdLimit
from .._core.bands import REJECT_BAND_BYTES, REJECT_BAND_COUNT
from .._core.saturation import EndpointLoad, free_slots, refresh
from .estimators import ServiceEstimate
from .lease import Lease
from .policies import Policy, make_policy
from .settings import AdmissionSettings
from .telemetry import Telemetry, percentiles
from .ticket import Rejected, Ticket

__all__ = ["Admission"]

log = logging.getLogger("velocity.admission")

_OOM_TEXT = "out of memory"
# An engine slower than this many times its usual service time, on a request that
# missed its SLA, counts as congested (AIMD cuts its limit).
CONGESTION_FACTOR = 1.5


class _EndpointState:
    """Admission's private view of one endpoint."""

    __slots__ = ("ep", "load", "aimd", "est")

    def __init__(self, ep, limit: int, aimd: AimdLimit | None, alpha: float) -> None:
        self.ep = ep
        self.aimd = aimd
        self.load = EndpointLoad(limit)
        self.est = ServiceEstimate(alpha)
        ep.limit = limit


class _PoolState:
    """One pool's queues and what is granted but not yet bound."""

    __slots__ = ("pool", "queues", "pending", "states", "loads", "seen", "overload_until")

    def __init__(self, pool, queues) -> None:
        self.pool = pool
        self.queues = queues
        self.pending = 0
        self.states: list[_EndpointState] = []
        self.loads: list[EndpointLoad] = []
        self.seen: list | None = None
        self.overload_until = 0.0


class Admission:
    """Whether and when each request runs. See docs/internals.md ("Admission").

    ``settings``: AdmissionSettings, or the top-level Settings (converted);
    ``pools``: model name -> Pool (shared with the router, may change);
    ``policy``: "static" | "dynamic" | "smart" or a Policy object;
    ``registry``: a metrics Registry (a private one when None).
    """

    def __init__(self, settings, pools: dict, policy: str | Policy = "dynamic", registry=None,
                 clock=time.monotonic) -> None:
        if not isinstance(settings, AdmissionSettings):
            settings = AdmissionSettings.from_settings(settings)
        self.settings = settings.validate()
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, self.settings)
        self.pools = pools
        self.clock = clock
        self.band_names = [b.name for b in self.policy.bands]
        self._ceilings = [b.ceiling for b in self.policy.bands]
        self._band_of = {n: i for i, n in enumerate(self.band_names)}
        self._default_band = self._band_of.get(self.settings.default_band, len(self.band_names) // 2)
        self._pools: dict[str, _PoolState] = {}
        self._eps: dict[int, _EndpointState] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._in_flight = 0
        self.telemetry = Telemetry(registry, self.band_names, self.settings.latency_window,
                                   self._depth_samples, self._saturation_samples, self._limit_samples,
                                   self._inflight_samples)
        for model in list(pools):
            self._pool_state(model)

    # -- the request path ------------------------------------------------------------

    async def admit(self, ticket: Ticket) -> Lease:
        """Grant a lease now or after a wait; raise Rejected when declined."""
        got = self.admit_nowait(ticket, None)
        if got.__class__ is Lease:
            return got
        fut, rid = got
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.withdraw(ticket, rid) and fut.done() and not fut.cancelled() \
                    and fut.exception() is None:
                fut.result().release("cancelled")
            raise

    def admit_nowait(self, ticket: Ticket, waiter):
        """Grant a lease now, raise Rejected, or queue ``waiter`` and return (waiter, queue id).

        ``waiter`` is a future or any object with ``done()``, ``set_result(lease)`` and
        ``set_exception(rejected)`` (called from the dispatch cycle: it must only
        schedule its work); None queues a new future. ``withdraw`` takes it back.
        """
        now = self.clock()
        ps = self._pools.get(ticket.model) or self._pool_state(ticket.model)
        if ps is None or not self._sync(ps):
            raise self._reject(503, "no-endpoint", "no healthy endpoint serves this model", 1)
        # No band name, or an unknown one: the default band (one band: its index 0 is
        # both the only name's and the default's).
        name = ticket.band
        band = self._band_of.get(name, self._default_band) if name else self._default_band
        if self.policy.oom_throttle and band > 0 and now < ps.overload_until:
            raise self._reject(503, "overload", "an engine ran out of memory; shedding non-high work",
                               max(1, math.ceil(ps.overload_until - now)))
        explicit = ticket.sla_ms is not None and ticket.sla_ms > 0
        deadline = now + (ticket.sla_ms if explicit else self.settings.sla_ms) / 1000.0
        if explicit and self.policy.sla_reject:
            self._check_sla(ps, band, ticket, now)
        q = ps.queues
        # Free slots on the pool's endpoints: nothing below binds or frees one, so the
        # count holds until this call returns.
        room = free_slots(ps.seen, ps.pending)
        # Nothing queued at or above this band: no one to overtake, go at once.
        if ((q.count == 0 or q.count_through(band) == 0) and room > 0
                and self.policy.saturation.pool(ps.loads, ps.pending, now) < self._ceilings[band]):
            return self._grant(ps, band, ticket.tenant, ticket.max_tokens, deadline, explicit, now, now)
        # With one pool (the common case) its queue is all that waits.
        cap = self.settings.global_capacity
        if cap and (q.count if len(self._pools) == 1 else self._queued_total()) >= cap:
            raise self._reject(503, "capacity", "admission queues are full", 1)
        if waiter is None:
            waiter = asyncio.get_running_loop().create_future()
        # The queue orders by its own fields; what the grant will need rides with the
        # waiter, as worked out here (the same deadline from the same arrival time).
        rid = q.enqueue((waiter, explicit, deadline, ticket.max_tokens), ticket.tenant, band, ticket.prompt_bytes,
                        ticket.max_tokens, deadline if explicit else math.inf, now)
        if rid < 0:
            what = "band" if rid in (REJECT_BAND_COUNT, REJECT_BAND_BYTES) else "admission"
            raise self._reject(503, "capacity", f"{what} queue is full ({self.band_names[band]})", 1)
        if room > 0:  # else the cycle would stop at once (the pool was just refreshed)
            self._dispatch(ps, now)
        # Under load the tick is already armed: no need to ask the waiter.
        if self._tick is None and not waiter.done():
            self._arm_tick()
        return waiter, rid

    def withdraw(self, ticket: Ticket, rid: int) -> bool:
        """Take a queued request out of its queue (its client left); False if no longer queued."""
        ps = self._pool_state(ticket.model)
        if ps is not None and ps.queues.cancel(rid) is not None:
            self.telemetry.queue_cancelled += 1
            return True
        return False

    def has_room(self, ep) -> bool:
        """True when ``ep`` may take one more request now (the router's filter)."""
        return ep.healthy and ep.inflight < ep.limit

    def _fits(self, lease: Lease, ep) -> bool:
        if not (ep.healthy and ep.inflight < ep.limit):
            return False
        ceiling = self._ceilings[lease.band_index]
        if ceiling >= 1.0:
            return True
        st = self._eps.get(id(ep))
        if st is None or st.ep is not ep:
            return True
        load = st.load
        load.inflight = ep.inflight
        load.limit = ep.limit
        return self.policy.saturation.endpoint(load, self.clock()) < ceiling

    def on_metrics(self, ep) -> None:
        """A scrape of ``ep`` landed: update saturation, check KV, maybe dispatch."""
        st = self._eps.get(id(ep))
        if st is None or st.ep is not ep:
            return
        now = self.clock()
        st.load.observe(ep.running, ep.waiting, ep.kv_usage, ep.scraped_at)
        if st.aimd is not None and ep.kv_usage > self.settings.kv_hard_limit:
            # One cut per staleness window: a full cache stays full for a few scrapes.
            if st.aimd.on_breach(now - self.settings.stale_after_ms / 1000.0, now):
                ep.limit = st.aimd.limit
        ps = self._pools.get(ep.model)
        if ps is not None:
            self._dispatch(ps, now)

    # -- bands, pools, endpoints -----------------------------------------------------

    def _pool_state(self, model) -> _PoolState | None:
        """The state of ``model``'s pool (None: the default pool), made on first use;
        None when there is no such pool. A pool once known keeps its state even after
        it left ``pools`` (its queue may still hold requests): a look-up in ``_pools``
        is this method's answer when it finds one."""
        if model is None or model not in self.pools:
            if model is not None and model in self._pools:
                return self._pools[model]
            model = next(iter(self.pools), None) if model is None else model
            if model is None or model not in self.pools:
                return None
        ps = self._pools.get(model)
        if ps is None:
            ps = self._pools[model] = _PoolState(self.pools[model], self.policy.make_queues(self.settings))
        return ps

    def _endpoint_state(self, ep) -> _EndpointState:
        # A state holds its endpoint: while it is in _eps, no other object can have
        # that id (the check on st.ep is a guard, not a case that arises).
        st = self._eps.get(id(ep))
        if st is None or st.ep is not ep:
            s = self.settings
            if self.policy.adaptive:
                aimd = AimdLimit(s.aimd_min, s.aimd_max, s.aimd_initial or s.aimd_max, s.oom_cooldown_ms / 1000.0)
                st = _EndpointState(ep, aimd.limit, aimd, s.ewma_alpha)
            else:
                st = _EndpointState(ep, s.aimd_max, None, s.ewma_alpha)
            self._eps[id(ep)] = st
        return st

    def _sync(self, ps: _PoolState) -> bool:
        """Refresh the compiled loads from the endpoints; True if any is healthy."""
        eps = ps.pool.endpoints
        # List equality falls back to identity for endpoints: a C-speed check that
        # the pool has not changed since the last cycle.
        if ps.seen != eps:
            ps.states = [self._endpoint_state(e) for e in eps]
            ps.loads = [s.load for s in ps.states]
            ps.seen = list(eps)
        return refresh(ps.loads, ps.seen)

    def _queued_total(self) -> int:
        return sum(ps.queues.count for ps in self._pools.values())

    # -- the dispatch cycle ----------------------------------------------------------

    def _dispatch(self, ps: _PoolState, now: float | None = None) -> None:
        """One cycle for ``ps``; ``now``: the caller's own reading of the clock, when
        it has just taken one (the cycle runs at the moment of what triggered it)."""
        q = ps.queues
        if q.count == 0:
            return
        # No room on the endpoints already known: nothing can go whatever the loads
        # say (most calls under full load), so their refresh is skipped. A pool whose
        # endpoints changed is refreshed first (_sync): a new endpoint may bring the
        # room. The same pool needs only its loads refreshed, which reads the
        # endpoints without changing them: the room counted before still holds.
        if ps.seen == ps.pool.endpoints:
            room = free_slots(ps.seen, ps.pending)
            if room <= 0:
                return
            healthy = refresh(ps.loads, ps.seen)
        else:
            healthy = self._sync(ps)
            room = free_slots(ps.seen, ps.pending)
        if not healthy:
            return
        if now is None:
            now = self.clock()
        # Nothing but the grants below changes the room in this cycle: each takes one.
        # Nor the pool's saturation: it is counted when first needed and again after
        # each grant (one more pending lease), not once per band.
        sat = None
        for band, ceiling in enumerate(self._ceilings):
            while True:
                if room <= 0:
                    return
                if sat is None:
                    sat = self.policy.saturation.pool(ps.loads, ps.pending, now)
                if sat >= ceiling:
                    return
                item = q.pop(band, now)
                if item is None:
                    break
                fut, explicit, deadline, max_tokens = item.waiter
                if fut.done():
                    continue
                room -= 1
                sat = None
                fut.set_result(self._grant(ps, item.band, item.tenant, max_tokens, deadline, explicit,
                                           item.enqueued_at, now))

    def _grant(self, ps, band: int, tenant, max_tokens: int, deadline: float, explicit: bool,
               arrived_at: float, now: float) -> Lease:
        ps.pending += 1
        self._in_flight += 1
        self.telemetry.granted(band, now - arrived_at)
        return Lease(self, ps, band, self.band_names[band], tenant, max_tokens, deadline, explicit,
                     arrived_at, now)

    # -- leases ----------------------------------------------------------------------

    def _on_bind(self, lease: Lease, ep, rebind: bool = False) -> None:
        ps = lease._ps
        if not rebind:
            ps.pending -= 1
        ep.inflight += 1
        # An endpoint admission knows already (the common case) needs no call.
        lease._st = self._eps.get(id(ep)) or self._endpoint_state(ep)
        if not rebind and ps.queues.count:
            # Pending leases count in full on every endpoint (saturation.pool): now
            # that this one has a place, the others' headroom is known again. With
            # nothing queued there is nobody to hand it to.
            self._dispatch(ps)

    def _on_first_byte(self, lease: Lease) -> None:
        lease._st.est.observe_first_byte(lease.first_byte_at - lease.bound_at)

    def _on_unbind(self, lease: Lease, ep) -> None:
        ep.inflight -= 1
        self._dispatch(lease._ps)

    def _on_release(self, lease: Lease, outcome: str, error_text: str | None, tokens: int) -> None:
        now = self.clock()
        ps = lease._ps
        ep = lease.endpoint
        self._in_flight -= 1
        ttft = lease.first_byte_at - lease.arrived_at if lease.first_byte_at else None
        sla_met = None
        if outcome == "completed":
            sla_met = now <= lease.deadline
        self.telemetry.finished(lease.band_index, outcome, now - lease.arrived_at, ttft, sla_met)
        if ep is None:
            ps.pending -= 1
        else:
            ep.inflight -= 1
            self._learn(ps, lease, ep, outcome, error_text, tokens, now)
        self._dispatch(ps, now)

    def _learn(self, ps, lease: Lease, ep, outcome: str, error_text, tokens: int, now: float) -> None:
        st = lease._st
        engine_ttft = lease.first_byte_at - lease.bound_at if lease.first_byte_at else None
        engine_s = now - lease.bound_at
        # What this engine usually takes for such a request, before this sample counts
        # (only an explicit SLA asks, below).
        expected = st.est.predict(int(tokens or lease.max_tokens)) if lease.explicit_sla else None
        if outcome == "completed":
            st.est.observe(engine_ttft, engine_s, int(tokens or lease.max_tokens))
        aimd = st.aimd
        if aimd is None:
            return
        if error_text and _OOM_TEXT in error_text.lower():
            self._on_oom(ps, st, now)
            return
        if outcome != "completed":
            return
        slow = engine_ttft is not None and engine_ttft * 1000.0 > self.settings.ttft_slo_ms
        # A miss is the engine's doing only if its own part overran the whole budget
        # (time queued in the gateway is not cured by a smaller engine limit) and it
        # was slower than usual: an SLA no engine could meet says nothing of load.
        missed = (lease.explicit_sla and engine_s > lease.deadline - lease.arrived_at
                  and expected is not None and engine_s > CONGESTION_FACTOR * expected)
        if slow or missed:
            aimd.on_breach(lease.bound_at, now)
        else:
            kv_ok = st.load.kv <= self.settings.kv_hard_limit
            at_limit = ep.inflight + 1 >= ep.limit
            aimd.on_sample(ps.queues.count > 0, at_limit, kv_ok, now)
        ep.limit = aimd.limit

    def _on_oom(self, ps: _PoolState, st: _EndpointState, now: float) -> None:
        st.aimd.on_oom(now)
        st.ep.limit = st.aimd.limit
        if not self.policy.oom_throttle:
            return
        ps.overload_until = max(ps.overload_until, st.aimd.frozen_until)
        retry = max(1, math.ceil(ps.overload_until - now))
        log.warning("engine %s ran out of memory: limit %d, shedding non-high work for %.1fs",
                    getattr(st.ep, "name", "?"), st.aimd.limit, ps.overload_until - now)
        shed = [it for it in ps.queues if it.band > 0]
        for it in shed:
            ps.queues.cancel(it.id)
            self._fail_waiter(it, 503, "overload", "an engine ran out of memory; shedding non-high work", retry)

    # -- SLA prediction --------------------------------------------------------------

    def _check_sla(self, ps: _PoolState, band: int, ticket: Ticket, now: float) -> None:
        q = ps.queues
        if q.count == 0 and self._in_flight_in(ps) == 0:
            return  # idle: never reject on a prediction
        service = None
        for st in ps.states:
            if st.ep.healthy and st.est.known:
                s = st.est.predict(ticket.max_tokens)
                if s is not None and (service is None or s < service):
                    service = s
        if service is None:
            return
        wait = self._expected_wait(ps, band, now)
        budget = ticket.sla_ms / 1000.0
        tol = self.settings.sla_tolerance_high if band == 0 else self.settings.sla_tolerance
        predicted = wait + service
        if predicted > budget * (1.0 + tol):
            raise self._reject(
                429, "sla", f"predicted completion {predicted * 1000:.0f} ms exceeds the SLA of "
                f"{ticket.sla_ms:.0f} ms", max(1, math.ceil(wait)))

    def _in_flight_in(self, ps: _PoolState) -> int:
        return ps.pending + sum(st.ep.inflight for st in ps.states)

    def _expected_wait(self, ps: _PoolState, band: int, now: float) -> float:
        """Queue wait ahead of a request of ``band``: the work queued at or above it,
        beyond the free room, drained at the pool's concurrency."""
        q = ps.queues
        ahead = q.count_through(band)
        room = free_slots(ps.seen, ps.pending)
        blocked = self.policy.saturation.pool(ps.loads, ps.pending, now) >= self._ceilings[band]
        if ahead < room and not blocked:
            return 0.0
        services = [st.est.service.value for st in ps.states
                    if st.ep.healthy and st.est.service.value is not None]
        if not services:
            return 0.0
        concurrency = sum(st.ep.limit for st in ps.states if st.ep.healthy) or 1
        return (ahead - max(room, 0) + 1) * (sum(services) / len(services)) / concurrency

    # -- housekeeping ----------------------------------------------------------------

    def _arm_tick(self) -> None:
        if self._tick is None:
            loop = asyncio.get_running_loop()
            self._tick = loop.call_later(self.settings.tick_ms / 1000.0, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        try:
            self.housekeep()
        except Exception:
            log.exception("admission housekeeping failed")
        if self._queued_total():
            self._arm_tick()

    def housekeep(self) -> None:
        """Expire TTLs, decline hopeless requests (smart), then dispatch (aging)."""
        now = self.clock()
        for ps in self._pools.values():
            q = ps.queues
            if q.count == 0:
                continue
            for it in q.expire(now):
                self._fail_waiter(it, 504, "ttl", "waited in the queue past its TTL", None)
            if self.policy.drop_hopeless and q.count:
                self._drop_hopeless(ps, now)
            self._dispatch(ps, now)

    def _drop_hopeless(self, ps: _PoolState, now: float) -> None:
        base = tpot = None
        for st in ps.states:
            if not (st.ep.healthy and st.est.known):
                continue
            t = st.est.ttft.value if st.est.ttft.value is not None else st.est.service.value
            p = st.est.tpot.value or 0.0
            base = t if base is None else min(base, t)
            tpot = p if tpot is None else min(tpot, p)
        if base is None:
            return
        # Only the best case counts (no queue wait, fastest endpoint): what is dropped
        # here could not have made it under any schedule.
        for it in ps.queues.pop_hopeless(now, base, tpot):
            self._fail_waiter(it, 429, "sla", "can no longer meet its SLA", 1)

    def _fail_waiter(self, item, status: int, reason: str, message: str, retry_after) -> None:
        fut = item.waiter[0]
        rej = self._reject(status, reason, message, retry_after)
        if not fut.done():
            fut.set_exception(rej)

    def _reject(self, status: int, reason: str, message: str, retry_after) -> Rejected:
        self.telemetry.reject(reason)
        return Rejected(status, reason, message, retry_after)

    def close(self) -> None:
        """Stop the housekeeping timer and fail whatever still waits (503)."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        for ps in self._pools.values():
            for it in list(ps.queues):
                ps.queues.cancel(it.id)
                self._fail_waiter(it, 503, "no-endpoint", "the gateway is shutting down", 1)

    # -- visibility ------------------------------------------------------------------

    def _depth_samples(self):
        depth = [0] * len(self.band_names)
        for ps in self._pools.values():
            for i in range(len(depth)):
                depth[i] += ps.queues.band(i).count
        return [((n,), d) for n, d in zip(self.band_names, depth)]

    def _known_pools(self) -> dict[str, _PoolState]:
        """Every pool's state, created for pools no request has asked for yet: the
        gateway adds its endpoints after building admission, and /stats and the
        metrics must show their limits before the first request."""
        for model in list(self.pools):
            if model not in self._pools:
                self._pool_state(model)
        return self._pools

    def _saturation_samples(self):
        now = self.clock()
        out = []
        for model, ps in self._known_pools().items():
            self._sync(ps)
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
        for model, ps in self._known_pools().items():
            self._sync(ps)
            sat = self.policy.saturation.pool(ps.loads, ps.pending, now)
            pools[model] = {"saturation": None if math.isinf(sat) else round(sat, 4), "queued": ps.queues.count,
                            "pending_leases": ps.pending,
                            "overload_s": round(max(0.0, ps.overload_until - now), 3)}
        endpoints = {}
        for st in self._eps.values():
            ep = st.ep
            endpoints[ep.name] = {
                "limit": ep.limit, "inflight": ep.inflight,
                "saturation": round(self.policy.saturation.endpoint(st.load, now), 4),
                "batch_capacity": st.load.capacity,
                "frozen": bool(st.aimd is not None and st.aimd.frozen(now)),
                "estimates": st.est.snapshot()}
        judged = tel.sla_met + tel.sla_missed
        return {
            "policy": self.policy.name,
            "counters": counts,
            "queued": self._queued_total(),
            "queue_cancelled": tel.queue_cancelled,
            "rejections": dict(tel.reasons),
            "bands": bands,
            "pools": pools,
            "limits": {name: e["limit"] for name, e in endpoints.items()},
            "endpoints": endpoints,
            "sla": {"met": tel.sla_met, "missed": tel.sla_missed,
                    "compliance": round(tel.sla_met / judged, 4) if judged else None},
            "latency_ms": {"e2e": percentiles(tel.e2e), "ttft": percentiles(tel.ttfts)},
        }
