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

from .._core.admission import AdmissionCore, EndpointState, Lease, PoolState, Telemetry, Ticket
from .policies import EngineSaturation, FixedConcurrency, Policy, make_policy
from .settings import AdmissionSettings
from .telemetry import percentiles

__all__ = ["Admission"]

log = logging.getLogger("velocity.admission")


class Admission(AdmissionCore):
    """Whether and when each request runs. See docs/internals.md ("Admission").

    The request path (``admit_nowait``, ``withdraw``, ``has_room``, the dispatch
    cycle, the lease's bind and release) is compiled: _core/admission.pyx, the
    ``AdmissionCore`` this class extends. What stays here runs rarely or per scrape.

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
        sat = self.policy.saturation
        self._configure(sat.model if type(sat) is EngineSaturation else None, type(sat) is FixedConcurrency)
        for model in list(pools):
            self._pool_state(model)

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
        st.load.observe(ep.running, ep.waiting, ep.kv_usage, ep.scraped_at)
        ps = self._pools.get(ep.model)
        if st.aimd is not None and ep.kv_usage > self.settings.kv_hard_limit:
            # One cut per staleness window: a full cache stays full for a few scrapes.
            if st.aimd.on_breach(now - self.settings.stale_after_ms / 1000.0, now):
                ep.limit = st.aimd.limit
        elif (st.aimd is not None and not st.load.capacity_known and ep.waiting == 0
              and ep.inflight + 1 >= ep.limit and ps is not None and ps.queues.count):
            # Slow start: the engine runs all it was sent and work waits on this limit.
            if st.aimd.on_probe(now):
                ep.limit = st.aimd.limit
        if ps is not None:
            self._dispatch(ps, now)

    # -- out of memory ---------------------------------------------------------------

    def _on_oom(self, ps: PoolState, st: EndpointState, now: float) -> None:
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

    # -- housekeeping ----------------------------------------------------------------

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

    def _drop_hopeless(self, ps: PoolState, now: float) -> None:
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
        fut = item.waiter
        rej = self._reject(status, reason, message, retry_after)
        if not fut.done():
            fut.set_exception(rej)

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

    def _known_pools(self) -> dict[str, PoolState]:
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
                # The engine's batch once learned (None: not yet shown), and the most seen running.
                "batch_capacity": st.load.capacity if st.load.capacity_known else None,
                "running_max": st.load.capacity,
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
