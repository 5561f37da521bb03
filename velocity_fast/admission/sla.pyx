"""The band-SLA queue model, and the Retry-After promises made from it.

Queue model: the engines drain the work ahead of a request, the leases held (each by its
own size, as far as it is still expected to run) and what is queued at or above its
band, at the rate of the slots this band may use. A request that free slots can take
with those ahead of it does not wait. Admission (controller.pyx) declines a request that
would queue when the predicted wait plus its own service passes its SLA, with the band's
tolerance (429 ``sla``).

A declined request is told when to come back (Retry-After): the time at which a request
arriving then would be admitted and meet its SLA. Each promise adds its own service to
the work ahead of the later ones, so a burst declined together comes back at the pace
the engines drain, not as one herd. Each promise is judged when it comes due, kept or
broken (``promise_counts``, ``velocity_retry_promises_total``).

Admission holds one SlaModel and a PoolWork per pool and calls these as C; whether a
request arriving now would go at once (saturation, free slots) is the dispatch cycle's
to say, and it hands the model the slots it found free.
"""

from collections import deque

from velocity_fast.admission.bands cimport BandQueue
from velocity_fast.admission.saturation cimport EndpointLoad
from velocity_fast.fleet.endpoint cimport Endpoint

RETRY_MARGIN = VF_RETRY_MARGIN
RETRY_MAX_S = VF_RETRY_MAX_S


cdef class PoolWork:
    """One pool's work admitted and queued, and the promises told ahead of it."""

    def __init__(self, BandQueues queues):
        self.queues = queues
        self.promises = deque()


cdef class SlaModel:
    """The queue model and the promise ledger of one admission controller.

    ``ceilings`` and ``soft_scales``: per band, its ceiling and its ceiling over its soft
    ceiling (1: the same); ``tolerance``, ``tolerance_high``: how far past its SLA a
    prediction may go, for the other bands and the first; ``promise_metric``: the counter
    of promises come due, by outcome."""

    def __init__(self, list ceilings, list soft_scales, double tolerance, double tolerance_high,
                 promise_metric=None):
        self.ceilings = ceilings
        self.soft_scales = soft_scales
        self.tol = tolerance
        self.tol_high = tolerance_high
        self.promise_counts = {"made": 0, "kept": 0, "broken": 0}
        self.promise_metric = promise_metric

    cdef double slots(self, list seen, list loads, int band) except? -1.0:
        """What the pool runs at once for ``band``: each healthy engine's limit, or its
        learned batch when smaller, times the band's share when its ceiling is below 1.
        ``seen``: the pool's endpoints; ``loads``: theirs, in the same order."""
        cdef Endpoint ep
        cdef EndpointLoad load
        cdef double slots = 0.0, cap, ceiling
        cdef Py_ssize_t i
        if seen is not None:
            for i in range(len(seen)):
                ep = <Endpoint>seen[i]
                if not ep.healthy:
                    continue
                load = <EndpointLoad>loads[i]
                cap = <double>ep.limit
                if load.capacity_known and load.capacity < cap:
                    cap = load.capacity
                slots += cap
        ceiling = self.ceilings[band]
        if ceiling < 1.0:
            slots *= ceiling  # the share of each engine this band may hold
        return slots if slots >= 1.0 else 1.0

    cdef double backlog(self, PoolWork w, int band, double now) except? -1.0:
        """The work (seconds of one slot) ahead of a request of ``band`` arriving now: what
        the leases held still have to run by their expected ends, and the expected service
        of what is queued at or above its band (the queue's share of its queued work)."""
        cdef double busy = w.busy_end - w.busy_n * now, queued = 0.0
        cdef long count = w.queues.count
        if busy < 0.0:
            busy = 0.0
        if count > 0 and w.queued_work > 0.0:
            queued = w.queued_work * w.queues.count_through(band) / count
        return busy + queued

    cdef double wait(self, PoolWork w, list seen, list loads, int band, long free, double now) except? -1.0:
        """The expected queue wait of a request of ``band`` arriving now; ``free``: the
        slots it may take at once (0: none, or the pool's saturation keeps them for higher
        bands)."""
        if w.queues.count_through(band) + 1 <= free:
            return 0.0
        return self.backlog(w, band, now) / self.slots(seen, loads, band)

    cdef double held_share(self, BandQueues q, bint learned) except? -1.0:
        """The share of an engine's limit the highest band with queued work may fill (its
        ceiling, at most 1; its soft ceiling while the engine's batch is not ``learned``): a
        limit is what holds that work back once in-flight reaches this share of it (as many
        as the band may hold, rounded down). Low work stops below all of the limit, so a
        limit that grew only when in-flight reached all of it would never grow for it."""
        cdef double c
        cdef int i
        for i in range(q.nbands):
            if (<BandQueue>q.bands[i]).count:
                c = self.ceilings[i]
                if not learned:  # the limit stands in for the batch: the soft ceiling holds
                    c /= <double>self.soft_scales[i]
                return c if c < 1.0 else 1.0
        return 1.0

    cdef double tolerance(self, int band) noexcept:
        """How far past its SLA a prediction may go before a 429: the first band's own."""
        return self.tol_high if band == 0 else self.tol

    cdef double promise(self, PoolWork w, list seen, list loads, int band, double service, double budget,
                        double now, bint* booked) except? -1.0:
        """When a declined request of ``band`` (own service ``service``, SLA ``budget``)
        should come back, in seconds from now: the time at which a request arriving then
        would be admitted and meet its SLA, with the retries already promised ahead of it.
        ``booked`` is set when the promise joined the ledger (to be judged when due).

        The work ahead now drains at the rate of the slots this band may use; each promise
        adds its own service to the work ahead of the later ones, so successive declines of
        a burst are told successive times, one service per slot apart. The time aims at a
        completion a tenth of the SLA before the deadline (RETRY_MARGIN). A float: the
        gateway writes whole seconds in Retry-After and the milliseconds in
        ``retry-after-ms``. The caller settles the promises come due first."""
        cdef double slots, allowed, ahead, at
        booked[0] = False
        if service < 0.0:
            service = 0.0
        slots = self.slots(seen, loads, band)
        # The wait that still meets the SLA; an SLA shorter than the service itself is
        # met by no wait: come back when the work ahead has drained.
        allowed = budget * (1.0 - VF_RETRY_MARGIN) - service
        if allowed < 0.0:
            allowed = 0.0
        ahead = self.backlog(w, band, now) + w.promised_work
        at = now + (ahead - allowed * slots) / slots
        if at < now:
            at = now
        if at < w.last_promise:
            at = w.last_promise
        self.promise_counts["made"] += 1
        if at - now > VF_RETRY_MAX_S:
            return VF_RETRY_MAX_S
        w.promises.append((at, service, band, budget))
        w.promised_work += service
        w.last_promise = at
        booked[0] = True
        return at - now

    cdef bint next_due(self, PoolWork w, double now, double* service, int* band, double* budget) except -1:
        """Take the next promise come due at ``now`` off the ledger, its ``service``, ``band``
        and ``budget`` to judge (``judged``); False when none is due."""
        promises = w.promises
        if promises and promises[0][0] <= now:
            _, s, b, g = promises.popleft()
            service[0], band[0], budget[0] = s, b, g
            w.promised_work -= s
            return True
        if not promises:
            w.promised_work = 0.0
        return False

    cdef void judged(self, bint kept) except *:
        """A promise come due was kept (a request arriving then would be admitted and meet
        its SLA) or broken (engines slower than learned, higher bands taking the room,
        arrivals nobody was told of)."""
        outcome = "kept" if kept else "broken"
        self.promise_counts[outcome] += 1
        if self.promise_metric is not None:
            self.promise_metric.labels(outcome).inc()
