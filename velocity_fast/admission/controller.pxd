# Admission's request path, typed (see controller.pyx for the why).

from velocity_fast.admission.aimd cimport AimdLimit
from velocity_fast.admission.bands cimport BandQueues, Item, TenantQueue, locality_fn
from velocity_fast.fleet.endpoint cimport Endpoint, RoomFilter
from velocity_fast.state.shm cimport PoolSlot
from velocity_fast.metrics.values cimport Value
from velocity_fast.admission.saturation cimport EndpointLoad, Saturation
from velocity_fast.admission.estimators cimport OutputEstimate, ServiceEstimate
from velocity_fast.admission.telemetry cimport Telemetry, COMPLETED, FAILED, CANCELLED
from velocity_fast.admission.pace cimport EndpointPace, PoolPace
from velocity_fast.admission.sla cimport PoolWork, SlaModel

cdef extern from "admission_consts.h":
    double VF_CONGESTION_FACTOR
    double VF_IDLE_RESET_S
    double VF_KV_PROJECTED


cdef class Ticket:
    cdef public object band
    cdef public object tenant
    cdef public object sla_ms
    cdef public long max_tokens
    cdef public long prompt_bytes
    cdef public object model


cdef class EndpointState:
    cdef readonly Endpoint ep
    cdef readonly EndpointLoad load
    cdef readonly AimdLimit aimd
    cdef readonly ServiceEstimate est
    # The engine's decode pace as the deadline work needs it (pace.pyx).
    cdef readonly EndpointPace pace
    # When the engine last showed work (this gateway's in flight, or its own gauges).
    cdef public double busy_at


cdef class PoolState:
    cdef readonly object pool
    cdef readonly BandQueues queues
    cdef public long pending
    cdef public double pending_tokens  # the pending leases' max_tokens (kv_ahead's part of them)
    cdef public list states
    cdef public list loads
    cdef public list seen
    cdef public double overload_until
    # The pool's own service estimate (every endpoint's answers), by request size.
    cdef readonly ServiceEstimate est
    # The work admitted and queued, and the Retry-After promises (sla.pyx).
    cdef readonly PoolWork work
    # Workers: the pool's slot in the shared state (NULL: one process), and a reservation
    # made there by the dispatch cycle for the item it is about to grant
    cdef PoolSlot *shm
    cdef bint spare
    # When a request of a band above the borrowing ones last arrived (-inf: never).
    cdef public double higher_at
    # When a request of a band the KV cache can hold back (one with a deadline and a
    # ceiling under 1 / kv_threshold: normal, not high) last arrived (-inf: never).
    cdef public double held_at
    # The pace the deadline work granted lately needs, and the engines' best (pace.pyx).
    cdef readonly PoolPace pace
    # The output tokens of a request that names no max tokens, learned from the pool's
    # answers: chat, and /v1/completions (which vLLM stops at 16 by default).
    cdef readonly OutputEstimate open_chat
    cdef readonly OutputEstimate open_text
    # Before this time no more batch work is granted (_space_batch).
    cdef public double batch_next
    # The last batch grant's max_tokens: what the next one is expected to bring (_pool_sat).
    cdef public double last_kv_tok


cdef class Admission
cdef class Lease


# A queued request's waiter that the dispatch cycle drives with C calls: whoever builds an
# Admission tells it its waiter class, with two functions (``Admission.set_waiter``; the
# gateway's assembler does, gateway/assemble.py). Any other waiter is driven like an
# asyncio future (``done()``, ``set_result()``, ``set_exception()``).
ctypedef bint (*waiting_fn)(object waiter) except -1
ctypedef void (*granted_fn)(object waiter, Lease lease) except *


cdef class Lease(RoomFilter):
    cdef readonly Admission _adm
    # Deadline-free (batch) work's max_tokens, counted in the engine's kv_ahead; 0 for the rest.
    cdef double _kv_tok
    # Batch work: the pick takes only an engine whose turn has come (batch_next) until
    # skip_turn says none had.
    cdef bint _any_turn
    cdef readonly PoolState _ps
    cdef readonly int band_index
    cdef readonly str band
    cdef readonly object tenant
    cdef readonly long max_tokens
    cdef readonly long prompt_bytes
    cdef readonly double expect_end
    cdef readonly double deadline
    cdef readonly double arrived_at
    cdef readonly double granted_at
    cdef readonly double bound_at
    cdef readonly double first_byte_at
    # P/D: the time from the bind to the decode leg's send (its prefill leg), which is not
    # the bound engine's doing: its time to first byte and service start after it.
    cdef readonly double handover_s
    cdef readonly Endpoint endpoint
    cdef readonly EndpointState _st
    cdef readonly bint done
    # Token fairness: the tenant's counter charged at dispatch (None: not charged), the
    # estimate charged, and the cost of what the engine served once it said (usage).
    cdef TenantQueue _fair_t
    cdef readonly double fair_charged
    cdef readonly double fair_actual
    cdef readonly bint fair_known
    # Workers: the pool's reservation is held (released with the lease); the endpoint's
    # slot was claimed before the bind
    cdef bint _reserved
    cdef bint _claimed

    cpdef bind(self, Endpoint ep)
    cpdef bint claim(self, Endpoint ep) except -1
    cpdef force(self, Endpoint ep)
    cpdef rebind(self, Endpoint ep)
    cpdef bint has_room(self, Endpoint ep) except -1
    cpdef bint skip_turn(self) except -1
    cpdef first_byte(self)
    cpdef handed_over(self)
    cpdef release(self, str outcome=*, error_text=*, long tokens=*)
    cpdef usage(self, double prompt, double cached, double completion)


cdef class Admission:
    cdef public object settings
    cdef public object policy
    cdef public object pools
    cdef public object clock
    cdef public list band_names
    cdef public list _ceilings
    cdef public dict _band_of
    cdef public int _default_band
    cdef public dict _pools
    cdef public dict _eps
    cdef object _last_ep          # the last endpoint looked up in _eps, and its state
    cdef EndpointState _last_st
    cdef public object _tick
    cdef public long _in_flight
    # Limits cut because an engine's pace was past what deadline work needs.
    cdef public long pace_cuts
    cdef public Telemetry telemetry
    # Settings and policy switches read on every request (set by _configure).
    cdef bint _mono
    cdef Saturation _sat
    cdef bint _fixed
    cdef object _sat_obj
    cdef double _sla_s
    # The band-SLA queue model and the Retry-After promise ledger (sla.pyx).
    cdef readonly SlaModel sla
    cdef long _global_capacity
    cdef double _kv_hard_limit
    cdef double _ttft_slo_ms
    cdef double _tick_s
    cdef bint _oom_throttle
    cdef bint _sla_reject
    cdef bint _adaptive
    cdef double output_weight     # token fairness: an output token's cost in input tokens
    cdef double cached_weight     # and a cached prompt token's
    cdef bint settle_usage        # token fairness settled from usage (fairness_charge: actual)
    cdef list _band_sla           # per band: its deadline in seconds (INFINITY: none)
    cdef list _soft_scales        # per band: its ceiling over its soft ceiling (1: the same)
    cdef unsigned long long _soft_breaks  # bit b: band b's soft scale differs from band b-1's
    cdef int _borrow_from         # the first band that may borrow past its ceiling (nbands: none)
    cdef list _held_bands         # per band: the KV cache can hold it back (sets held_at)
    cdef double _borrow_after     # seconds without a higher band's request before it may
    # The waiter class driven as C, and its two functions (set_waiter; None, NULL: none).
    cdef type _waiter_type
    cdef waiting_fn _c_waiting
    cdef granted_fn _c_granted
    cdef locality_fn _locality    # how a queued request's prefix stands (set_locality; NULL: unknown)

    cdef void set_waiter(self, type kind, waiting_fn waiting, granted_fn granted) noexcept
    cdef inline bint _waiting(self, waiter) except -1
    cdef void set_locality(self, locality_fn fn) except *
    cdef double _now(self) except? -1.0
    cdef double _pool_sat(self, PoolState ps, double now, int band) except? -1.0
    cdef double _endpoint_sat(self, PoolState ps, EndpointLoad load, double now, int band) except? -1.0
    cdef double _peak_cap(self, PoolState ps, int band, double now) noexcept
    cdef double _ceiling(self, PoolState ps, int band, double now) except? -1.0
    cpdef object admit_nowait(self, Ticket ticket, waiter)
    cpdef OutputEstimate open_estimate(self, model, bint chat)
    cpdef bint withdraw(self, Ticket ticket, Item item) except -1
    cdef long _free_for(self, PoolState ps, int band, long room, double sat, double now) except -1
    cdef void _check_sla(self, PoolState ps, int band, double service, double budget, long room, double sat,
                         double now) except *
    cdef PoolState _state_of(self, model)
    cdef EndpointState _ep_state(self, Endpoint ep)
    cdef EndpointState _known_state(self, Endpoint ep)
    cdef bint _refresh(self, PoolState ps) except -1
    cdef long _queued(self) except -1
    cdef void _cycle(self, PoolState ps, double now, bint have_now) except *
    cdef void _cycle_run(self, PoolState ps, double now, bint have_now) except *
    cdef Lease _grant(self, PoolState ps, int band, tenant, long max_tokens, long prompt_bytes, double service,
                      double deadline, double arrived_at, double now)
    cdef void _on_bind(self, Lease lease, Endpoint ep, bint rebind) except *
    cdef void _on_unbind(self, Lease lease, Endpoint ep) except *
    cdef void _on_release(self, Lease lease, int outcome, error_text, long tokens) except *
    cdef void _learn(self, PoolState ps, Lease lease, Endpoint ep, int outcome, error_text, long tokens,
                     double now) except *
    cdef void _arm(self) except *
