"""Saturation: how close an engine, and a pool of them, is to queueing work.

Per endpoint the number is the worse of queue depth and KV-cache occupancy, each
against its threshold (1.0 = saturated). Two lags of scraped metrics are closed:

* Scrapes are an interval old, so the gateway's own in-flight count is held against
  the engine's batch capacity, learned as the high-water mark of observed
  ``running``: in-flight beyond that capacity is what really queues in the engine.
  Until two scrapes in a row have shown a queue beside as many running requests as
  ever seen (at least two waiting, and a tenth of those running: the engine holds more
  than it has ever run and will not run them, so ``running`` is at its ceiling), the
  concurrency limit stands in for the capacity. Requests that arrived since the
  engine's last step are no proof: a steady stream leaves a few waiting in most scrapes,
  and a batch that ends together is replaced together, with fewer running meanwhile.
  Nor is a queue beside a step that did not end (a cold prompt's prefill): where the
  engine's inter-token histogram gives the tokens decoded between the scrapes, the second
  needs a step for every running sequence, and running not grown, to count.
* A request granted but not yet dispatched is invisible to both; the pool number
  takes those outstanding leases as extra in-flight work.
* Other gateways in front of the same engines (replicas) are seen in the engine's
  gauges only: what a scrape shows running beyond the most this gateway had in flight
  there while the scrape was on its way (``others``; fleet/health.py starts the window
  when it sends the scrape) is theirs (what waits in the engine, theirs
  or ours, is the queue term already), the most of the last three scrapes' readings.
  It counts as
  in-flight work beside the gateway's own, for as long as the scrape is fresh, so that
  replicas together keep to the bands' ceilings of one engine's batch. Subtracting the
  most this gateway had in flight, not what it has now, keeps a single gateway's
  ``others`` at zero: the engine never counts more of its requests than it sent.

The gateway's own use of the engine, in-flight against the smaller of the
concurrency limit and the learned batch capacity, is a third term: a band ceiling
of 1.0 then means "flow up to what the engine can run at once", and a ceiling of
0.8 keeps a fifth of every engine's batch free for higher bands, so that a short
high request never waits behind a full house of low ones. The user need not know
the engine's batch size (``--max-num-seqs``, or its KV blocks): with the default
limit above it, the capacity learned from the engine's gauges bounds the bands.

The engine's own waiting count and the gateway's estimate are combined with max,
not summed: the engine's count already includes the gateway's queued requests.
A stale or missing scrape drops the engine terms and keeps the gateway's own count,
so a scrape that hangs never halts dispatch.
"""

from libc.math cimport INFINITY
from libc.stdlib cimport free, qsort, realloc

from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.state.shm cimport batch_learned, inflight_total, learn_batch, shared_limit

QUEUE_THRESHOLD = VF_QUEUE_THRESHOLD
KV_THRESHOLD = VF_KV_THRESHOLD
STALE_AFTER_S = VF_STALE_AFTER_S


# kv_peak's list of the bound requests (their tokens left and their answers), on the stack.
cdef enum:
    _PEAK_MAX = 512

ctypedef struct _Left:
    double left
    double answer


cdef int _by_left(const void* a, const void* b) noexcept nogil:
    cdef double x = (<const _Left*>a).left, y = (<const _Left*>b).left
    return -1 if x < y else (1 if x > y else 0)


cdef class EndpointLoad:
    """What saturation knows of one endpoint: last scrape plus the gateway's counts."""

    def __cinit__(self, long limit=1):
        self.limit = limit
        self.healthy = True
        self.out_share = 1.0

    def __dealloc__(self):
        free(self._b_at)
        free(self._b_tok)

    cpdef void observe(self, double running, double waiting, double kv, double scraped_at,
                       double decoded=-1.0):
        """Record one scrape of the engine's gauges; ``decoded``: the output tokens the
        engine decoded since the last scrape (-1: not known)."""
        cdef double before = self.running
        self.running = running
        self.waiting = waiting
        self.kv = kv
        self.scraped_at = scraped_at
        if running > self.capacity:
            self.capacity = running
        # A queue in one scrape may be requests that arrived since the engine's last step
        # (a burst does that at any load); a queue still there a scrape later, with
        # requests running, is the engine at its ceiling, once a step ran in between
        # (every running sequence decoded a token) and took none of it in. Without that
        # proof a long step (a cold prompt's prefill, 200 ms and more) spans two scrapes
        # with the queue that arrived during it: a fresh engine learned a batch of 1 to 4
        # that way and was held there for good.
        if waiting >= 2.0 and waiting >= 0.1 * running and running > 0 and running >= self.capacity:
            if self.queue_seen and (decoded < 0.0 or (decoded >= running and running <= before)):
                self.capacity_known = True
            self.queue_seen = True
        else:
            self.queue_seen = False

    cpdef void bind_work(self, double max_tokens, double at, double sign) noexcept:
        """A request bound here (sign 1, at its bind time) or gone (sign -1, the same
        time): the sums ``kv_ahead`` reads."""
        cdef int i, cap
        cdef double* a
        cdef double* t
        if sign > 0.0:
            if self._b_n == self._b_cap:
                cap = self._b_cap * 2 if self._b_cap else 64
                a = <double*>realloc(self._b_at, cap * sizeof(double))
                if a != NULL:
                    self._b_at = a
                t = <double*>realloc(self._b_tok, cap * sizeof(double))
                if t != NULL:
                    self._b_tok = t
                if a != NULL and t != NULL:
                    self._b_cap = cap
            if self._b_n < self._b_cap:
                self._b_at[self._b_n] = at
                self._b_tok[self._b_n] = max_tokens
                self._b_n += 1
        else:
            for i in range(self._b_n):
                if self._b_at[i] == at and self._b_tok[i] == max_tokens:
                    self._b_n -= 1
                    self._b_at[i] = self._b_at[self._b_n]
                    self._b_tok[i] = self._b_tok[self._b_n]
                    break
        self.bound_n += sign
        if self.bound_n <= 0.0:  # none left: no drift left behind by the sums
            self.bound_n = self.bound_tokens = self.bound_t = 0.0
            self._b_n = 0
            return
        self.bound_tokens += sign * max_tokens
        self.bound_t += sign * at

    cdef void ended(self, double tokens, double max_tokens) noexcept:
        """A request here ended having decoded ``tokens`` of its ``max_tokens``: clients
        that ask for far more than the answer takes (a max_tokens of 4096 on chat) must
        not hold the cache as if every answer ran to it."""
        cdef double share
        if tokens <= 0.0 or max_tokens <= 0.0:
            return
        share = tokens / max_tokens
        self.out_share += 0.1 * ((share if share < 1.0 else 1.0) - self.out_share)

    cpdef double kv_ahead(self, double now) noexcept:
        """The share of the engine's KV cache this gateway's requests there will still
        add as they decode: their max_tokens less what the engine's pace has decoded of
        them since their bind (all of it while the pace is unknown). The usage gauge
        shows only what they hold now; a flood admitted while it is low fills the cache
        a few seconds later, and then the engine preempts and queues, higher work too.
        Each is expected to decode ``out_share`` of its max_tokens, as those before did."""
        cdef double left
        if self.kv_tokens <= 0.0 or self.bound_n <= 0.0:
            return 0.0
        left = self.bound_tokens * self.out_share
        if self.pace > 0.0:
            left -= (self.bound_n * now - self.bound_t) / self.pace
        return left / self.kv_tokens if left > 0.0 else 0.0

    cpdef double kv_peak(self, double extra_n=0.0, double extra_tokens=0.0) noexcept:
        """The most of the engine's KV cache (a share) its usage will reach from the last
        scrape on, as the batch requests bound here decode and end: each adds a token a
        step until it has decoded ``out_share`` of its max_tokens, then frees what it
        decoded. ``extra_tokens`` over ``extra_n`` requests not bound yet count as fresh
        ones. Requests that end at different times do not all hold their whole answer
        at once: the sum of their answers (kv_ahead) is the peak only of a batch that
        ends together. Past _PEAK_MAX requests (or with no memory for the list), that
        sum."""
        cdef double T = self.kv_tokens, pace = self.pace, s = self.scraped_at
        cdef _Left buf[_PEAK_MAX]
        cdef int n = 0, i, j, k
        cdef double x, y, peak, cum_r = 0.0, cum_m = 0.0, v, share = self.out_share
        if T <= 0.0:
            return self.kv
        k = (<int>extra_n if extra_n >= 1.0 else 1) if extra_tokens > 0.0 else 0
        if self._b_n + k > _PEAK_MAX or self._b_n < <int>self.bound_n:
            return self.kv + self.kv_ahead(s) + extra_tokens * share / T
        for i in range(self._b_n):
            y = self._b_tok[i] * share
            x = y
            if pace > 0.0:
                x = y - (s - self._b_at[i]) / pace
                if x > y:
                    x = y
                if x < 1.0:  # due to end: one more step
                    x = 1.0 if y >= 1.0 else y
            buf[n].left = x
            buf[n].answer = y
            n += 1
        if k:
            y = extra_tokens * share / k
            for i in range(k):
                buf[n].left = y
                buf[n].answer = y
                n += 1
        qsort(buf, n, sizeof(_Left), _by_left)  # in the order they end
        peak = self.kv * T
        for j in range(n):
            # Just before the j-th ends: those still running have each decoded its left
            # more, those ended before it all theirs and freed their answers.
            v = self.kv * T + cum_r + (n - j) * buf[j].left - cum_m
            if v > peak:
                peak = v
            cum_r += buf[j].left
            cum_m += buf[j].answer
        return peak / T

    cdef bint held_by_cache(self, double now) noexcept:
        """The engine's KV cache, with every answer of its batch requests whole (kv_ahead),
        is what holds work back there: its batch is bound by the cache, not by a count
        that a probe could find (the caller judges the scrape fresh). The sum, not the peak
        (kv_peak): requests bound evenly apart keep the peak just under the band's share,
        and a test on it came and went with every bind, and borrowing with it."""
        return self.kv_tokens > 0.0 and self.kv + self.kv_ahead(now) >= VF_KV_HELD * VF_KV_PROJECTED

    cdef void learn_fixed(self, double block) noexcept:
        """What each request holds of the cache besides the tokens it decoded (kv_fixed):
        its prompt's blocks not shared with others, its last block's unused part, its
        share of a shared prefix. Read off a scrape: the cache in use less what the batch
        requests bound here have decoded at the engine's pace, over their count. Starts
        at two blocks (a prompt's last, partly shared, and the one its answer fills)."""
        cdef double decoded = 0.0, x, y, f
        cdef int i
        if self.kv_fixed <= 0.0:
            self.kv_fixed = 2.0 * block if block > 0.0 else 32.0
        if self.kv_tokens <= 0.0 or self.pace <= 0.0 or self._b_n < 4:
            return
        for i in range(self._b_n):
            y = self._b_tok[i] * self.out_share
            x = (self.scraped_at - self._b_at[i]) / self.pace
            decoded += x if x < y else y
            if x < 0.0:
                return  # bound after the scrape: not in what it shows
        f = (self.kv * self.kv_tokens - decoded) / self._b_n
        if f < 0.5 * block:
            f = 0.5 * block
        self.kv_fixed += 0.2 * (f - self.kv_fixed)

    cdef double batch_interval(self, double max_tokens, double cap) noexcept:
        """Seconds between two batch requests of ``max_tokens`` bound here, for such
        requests to keep ``cap`` of the cache in use when they are spread evenly over
        their answers' time: each holds kv_fixed and, on average, half its answer, so
        cap C / (m / 2 + kv_fixed) fit, and each runs m tokens at the engine's pace. An
        unknown pace is taken as 25 ms a token. 0: the cache is not known."""
        cdef double m, pace
        if self.kv_tokens <= 0.0 or cap <= 0.0 or max_tokens <= 0.0:
            return 0.0
        pace = self.pace if self.pace > 0.0 else 0.025
        m = max_tokens * self.out_share
        return m * pace * (0.5 * m + self.kv_fixed) / (cap * self.kv_tokens)

    def __repr__(self):
        return (f"EndpointLoad(running={self.running}, waiting={self.waiting}, "
                f"kv={self.kv}, inflight={self.inflight}, limit={self.limit}, "
                f"capacity={self.capacity}, value={self.value:.3f})")


cpdef void observe_endpoint(EndpointLoad load, Endpoint ep):
    """Record ``ep``'s latest scrape in ``load``, with what it shows of other gateways'
    work (``others``, also kept on the endpoint for the router), and start the next
    interval's count of this gateway's own in-flight peak."""
    cdef double others
    cdef int i
    load.observe(ep.running, ep.waiting, ep.kv_usage, ep.scraped_at, ep.decoded)
    load.pace = ep.pace
    blocks, size = ep.num_gpu_blocks, ep.block_size
    load.kv_tokens = <double>blocks * <double>size if blocks and size else 0.0
    load.learn_fixed(<double>size if size else 0.0)
    if load.capacity_known:  # workers: the batch one learned is every one's
        learn_batch(ep.shm, load.capacity)
    # Running only: the engine's waiting requests, theirs and ours, are the queue term.
    others = ep.running - <double>ep.inflight_peak
    load.seen[load.seen_at] = others if others > 0.0 else 0.0
    load.seen_at = (load.seen_at + 1) % OTHERS_SCRAPES
    # The most of the last few readings: one scrape taken while a batch had just ended
    # and its successors not yet begun (the engine replaces them a step later) shows
    # fewer running than the gateways keep there, and read alone it would let every
    # replica fill the gap at once, past its bands' ceilings. Another replica's work
    # does not vanish in a scrape interval; a gateway alone reads zeros and keeps zero.
    others = load.seen[0]
    for i in range(1, OTHERS_SCRAPES):
        if load.seen[i] > others:
            others = load.seen[i]
    load.others = others
    ep.others = load.others
    ep.inflight_peak = ep.inflight


cpdef bint refresh(list loads, list eps) except -1:
    """Bring each load up to date with its endpoint (``eps[i]`` for ``loads[i]``):
    the gateway's counts always, the engine's gauges when another scrape landed.
    True if any endpoint is healthy. One call for the whole pool: admission runs
    it on every arrival and every dispatch."""
    cdef EndpointLoad load
    cdef Endpoint ep
    cdef Py_ssize_t i, n = len(loads)
    cdef bint any_healthy = False
    if len(eps) != n:
        raise ValueError("refresh: one endpoint per load")
    for i in range(n):
        load = loads[i]
        ep = eps[i]
        if ep.shm != NULL:
            sync_shared(ep, load)
        load.healthy = ep.healthy
        load.inflight = ep.inflight
        load.limit = ep.limit
        if ep.scraped_at != load.scraped_at:
            observe_endpoint(load, ep)
        if ep.healthy:
            any_healthy = True
    return any_healthy


cdef void sync_shared(Endpoint ep, EndpointLoad load) noexcept:
    """Workers: the endpoint's counts as every worker made them (state/shm.pyx): the
    requests in flight (``inflight`` is their total; the peak with it), the smallest
    limit a worker set, the largest batch one learned."""
    cdef long limit
    cdef double cap
    ep.inflight = inflight_total(ep.shm, ep.inflight)
    if ep.inflight > ep.inflight_peak:
        ep.inflight_peak = ep.inflight
    limit = <long>shared_limit(ep.shm)
    if limit > 0:
        ep.limit = limit
    if load is not None:
        cap = batch_learned(ep.shm)
        if cap > 0.0 and (not load.capacity_known or cap > load.capacity):
            load.capacity = cap
            load.capacity_known = True


cpdef long free_slots(list eps, long pending) except? -1:
    """Room on a pool's endpoints, as admission counts it: the free slots of each
    healthy endpoint below its limit, less ``pending`` (granted, not yet bound)."""
    cdef long room = -pending, inflight, limit
    cdef Endpoint ep
    for ep in eps:
        if ep.shm != NULL:
            sync_shared(ep, None)
        if ep.healthy:
            inflight = ep.inflight
            limit = ep.limit
            if inflight < limit:
                room += limit - inflight
    return room


cdef class Saturation:
    """The saturation formula with its thresholds (defaults: 5 waiting, 0.8 KV)."""

    def __cinit__(self, double queue_threshold=VF_QUEUE_THRESHOLD,
                  double kv_threshold=VF_KV_THRESHOLD,
                  double stale_after=VF_STALE_AFTER_S):
        if queue_threshold <= 0 or kv_threshold <= 0:
            raise ValueError("saturation thresholds must be positive")
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.stale_after = stale_after

    cpdef double endpoint(self, EndpointLoad load, double now, double extra=0.0, double soft_scale=1.0,
                          double extra_tokens=0.0, double peak_cap=0.0):
        """Saturation of one endpoint at ``now`` with ``extra`` in-flight requests
        (outstanding leases, ``extra_tokens`` their max_tokens) on top of its own: the
        worst of queued / queue
        threshold, KV / KV threshold (fresh scrapes only) and in-flight / limit. Also
        stored in ``load.value``.

        ``soft_scale`` (a band's ceiling over its soft ceiling) weighs what the gateway
        only guesses of the engine: its KV use, which grows as the requests running decode
        (not for batch work where the cache as it will be is projected: that holds it
        alone), and in-flight over the concurrency limit while it stands in for a batch not
        yet learned. In-flight over a learned batch is exact: it is not scaled.

        ``peak_cap`` above 0: the projected cache (its peak over 95 %) counts only past
        this, where it counts as itself, instead of against the band's ceiling (batch work
        while no band the cache holds back has asked: Admission._peak_cap)."""
        cdef double cap, queued, s, k, room
        cdef bint projected, by_cache = False
        cdef bint fresh = load.scraped_at > 0.0 and now - load.scraped_at <= self.stale_after
        cap = load.capacity
        if not load.capacity_known and cap < load.limit:
            cap = load.limit
        if cap < 1.0:
            cap = 1.0
        if fresh:
            extra += load.others  # other replicas' work, while the scrape that showed it holds
        queued = load.inflight + extra - cap
        if queued < 0.0:
            queued = 0.0
        if fresh:
            if load.waiting > queued:
                queued = load.waiting
            s = queued / self.queue_threshold
            projected = (load.bound_n > 0.0 or extra_tokens > 0.0) and load.kv_tokens > 0.0
            # The usage gauge, for batch work (soft_scale above 1) a guess of what the
            # cache will hold: not where the cache as it will be is projected below, which
            # starts from the same gauge and adds what the bound work will decode. Both
            # held batch work to the lower (the guess's 0.56 of the cache, the peak's 0.76
            # at low's ceiling): the gauge stopped it whenever the work already bound had
            # decoded halfway, it came back in a burst when that work ended, and the cache
            # swung between a quarter and three quarters full, in waves an answer apart.
            if not (projected and soft_scale > 1.0):
                k = load.kv / self.kv_threshold * soft_scale
                if k > s:
                    s = k
            # The cache as it will be once the batch work bound here has decoded
            # (kv_ahead: deadline-free leases only, Lease._kv_tok): work that fills a
            # KV-bound cache seconds after its admission must not crowd out better
            # work, nor be granted more of it under a higher band's ceiling (aged up).
            if projected:
                k = load.kv_peak(extra - 1.0, extra_tokens) / VF_KV_PROJECTED
                if k > s and (peak_cap <= 0.0 or k > peak_cap):
                    s = k
                # Batch work on an engine its cache holds: the projection above is what
                # bounds it there, not the limit below, which stands in for a batch never
                # reached.
                by_cache = soft_scale > 1.0 and load.held_by_cache(now)
        else:
            s = queued / self.queue_threshold
        # In-flight against what the engine can actually run: its concurrency limit, or
        # its learned batch capacity once a scrape has shown it, whichever is smaller. A
        # band's ceiling is then a share of the engine's real batch, whatever the limit.
        room = <double>load.limit
        if load.capacity_known and cap < room:
            room = cap
        if room > 0.0:
            k = (load.inflight + extra) / room
            # A limit that stands in for a batch not learned is a guess, held to the
            # band's soft ceiling; not where the engine's cache holds batch work (by_cache):
            # held there at low's soft ceiling of a limit of 32, batch work kept 22 in
            # flight where the pace aims at 24, and ran 0.87x `static`'s requests/s.
            if not load.capacity_known and not by_cache:
                k *= soft_scale
            if k > s:
                s = k
        load.value = s
        return s

    cpdef double update(self, EndpointLoad load, double running, double waiting,
                        double kv, double scraped_at, double now):
        """Record a scrape and return the endpoint's new saturation."""
        load.observe(running, waiting, kv, scraped_at)
        return self.endpoint(load, now, 0.0)

    cpdef double pool(self, list loads, double pending, double now, double soft_scale=1.0, double pending_tokens=0.0,
                      double peak_cap=0.0):
        """One number for a pool: the minimum over its eligible endpoints.

        Minimum, not an average: the router sends the next request to an endpoint
        with headroom, so the pool can take work while any healthy endpoint below
        its limit is unsaturated; one hot engine must not hold back the others.
        Eligible = healthy and in-flight below its limit; if none is below its
        limit, every healthy endpoint counts. ``pending`` leases (granted, not yet
        bound) are all counted on each endpoint: the router may send them all to
        the one with the most headroom, and spreading them evenly would grant a
        band more than any single endpoint can take under its ceiling (the extra
        leases then land above it and eat the slots kept for higher bands). The
        controller re-runs dispatch when a lease binds, so this costs no
        throughput. No healthy endpoint: infinity.
        """
        cdef EndpointLoad e
        cdef Py_ssize_t n = 0
        cdef bint any_room = False
        cdef double best = INFINITY, s
        for e in loads:
            if e.healthy and e.inflight < e.limit:
                any_room = True
                n += 1
        if not any_room:
            for e in loads:
                if e.healthy:
                    n += 1
        if n == 0:
            return INFINITY
        for e in loads:
            if not e.healthy or (any_room and e.inflight >= e.limit):
                continue
            s = self.endpoint(e, now, pending, soft_scale, pending_tokens, peak_cap)
            if s < best:
                best = s
        return best
