"""Admission settings: msgspec Structs with validation (defaults live here).

``AdmissionSettings.from_settings(settings)`` builds them from the top-level
configuration (its ``bands``, ``sla_ms``, ``max_concurrency`` and the free-form
``admission:`` mapping), so the YAML keys under ``admission:`` are these field names.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .errors import AdmissionConfigError

__all__ = ["BandSettings", "AdmissionSettings", "POLICIES"]

POLICIES = ("static", "dynamic", "smart")

# The range of every number (docs/configuration.md, "Ranges"): msgspec checks them where
# the settings are read, so a value out of range never reaches the controller. Times stop
# at a day, counts at what one process can hold, so no value makes an infinite wait, an
# integer overflow or an allocation that cannot succeed.
DAY_MS = 86_400_000.0
_Ms = Annotated[float, msgspec.Meta(gt=0, le=DAY_MS)]  # a duration
_MsOrOff = Annotated[float, msgspec.Meta(ge=0, le=DAY_MS)]  # 0: off
_Count = Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]  # 0: no limit
_Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**40)]  # 0: no limit
_Concurrency = Annotated[int, msgspec.Meta(ge=1, le=100_000)]
_Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
_Waiting = Annotated[float, msgspec.Meta(gt=0, le=1_000_000)]  # requests waiting in an engine
_Tolerance = Annotated[float, msgspec.Meta(ge=0, le=100)]  # a fraction of the deadline


class BandSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One priority band. ``queue_bytes`` 0 = no byte limit; ``ttl_ms`` 0 = no TTL.

    ``sla_ms``: the deadline of this band's requests that name none of their own (nor
    their tenant); None: the server's ``sla_ms``; 0: none. A request without a deadline
    is never declined on a prediction: it waits its turn and fills what the engines run
    up to the band's ceiling (batch work is judged by throughput, not by a deadline)."""

    name: str
    ceiling: Annotated[float, msgspec.Meta(gt=0, le=1000)]
    queue_capacity: _Count = 1000
    queue_bytes: _Bytes = 0
    ttl_ms: _MsOrOff = 30000.0
    # Fairness between this band's tenants: rr, tokens or locality (None: admission.fairness).
    fairness: str | None = None
    # 0: no deadline; None: the server's sla_ms.
    sla_ms: Annotated[float, msgspec.Meta(ge=0, le=86_400_000)] | None = None
    # The ceiling on what the gateway only guesses of an engine (None: the ceiling): its KV
    # use, which grows as the requests running decode, and its concurrency limit while it
    # stands in for a batch not yet learned. Batch work fills all of a learned batch but a
    # slot (0.95), and 0.7 of a guess: a guess overfills the engine's own FIFO queue, where
    # priorities no longer apply (an engine bound by its KV blocks never shows its batch).
    soft_ceiling: Annotated[float, msgspec.Meta(gt=0, le=1000)] | None = None


def _default_bands() -> list[BandSettings]:
    return [
        BandSettings(name="high", ceiling=1.5, queue_capacity=1000, ttl_ms=60000.0),
        BandSettings(name="normal", ceiling=1.0, queue_capacity=1000, ttl_ms=30000.0),
        # Batch work: no deadline, and all of each engine's batch but a slot or a
        # twentieth, whichever is more, kept for higher bands.
        BandSettings(name="low", ceiling=0.8, queue_capacity=5000, ttl_ms=120000.0, sla_ms=0.0, soft_ceiling=0.7),
    ]


class AdmissionSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything admission needs to know; times in milliseconds unless named _s."""

    bands: list[BandSettings] = msgspec.field(default_factory=_default_bands)
    # The band of a request that names none (the gateway answers 400 to a band name that
    # does not exist; a ticket of an unknown band gets this one here).
    default_band: str = "normal"
    # Across all bands and pools: 0 = no limit.
    global_capacity: _Count = 10000
    global_bytes: _Bytes = 0
    # Saturation thresholds (docs/design.md, "Admission") and when a scrape counts as stale.
    queue_threshold: _Waiting = 5.0
    kv_threshold: _Fraction = 0.8
    # KV above this on a scrape is a breach for AIMD (x0.75).
    kv_hard_limit: _Fraction = 0.95
    stale_after_ms: _Ms = 1000.0
    # Anti-starvation: a waiting request rises one band per step (0 = off). A
    # backstop, not a scheduler: a short step would let a deep low backlog rise
    # into the headroom kept for higher bands.
    aging_step_ms: _MsOrOff = 30000.0
    # Borrowing: the lowest bands with no deadline fill all of each engine's known batch
    # but a slot once no higher band has asked in the pool for this long (0: never; they
    # keep to their ceilings).
    borrow_after_ms: _MsOrOff = 60000.0
    # Between tenants: "rr" (turns) or "tokens" (virtual token counter).
    fairness: str = "rr"
    # Token fairness: the cost of a request is its prompt tokens plus this many times its
    # output tokens (VTC's and llm-d's 2), prompt tokens the engine had cached counting
    # fairness_cached_weight each; "actual" settles the estimate charged at dispatch to
    # the engine's usage when the answer ends, "estimate" keeps the estimate.
    fairness_output_weight: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 2.0
    fairness_cached_weight: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    fairness_charge: str = "actual"
    # fairness: locality: a tenant whose counter is at most this far (tokens / weight)
    # past the least-served backlogged tenant's may be served first when an engine with
    # room holds its request's prefix. Fairness then holds within this bound (plus the
    # counter's own, twice the largest request's cost).
    fairness_locality_bound: Annotated[float, msgspec.Meta(ge=0, le=1e12)] = 4000.0
    # The server's SLA: the deadline of every request that names none of its own (nor
    # its tenant): predicted, declined early (429 sla), judged for compliance and AIMD.
    sla_ms: _Ms = 3000.0
    # A prediction may exceed the deadline by this fraction before 429 (high: more).
    # 0 keeps the promise that what is admitted finishes within its SLA (the queue model
    # is the engines' own measured pace); high trades that for fewer declines.
    sla_tolerance: _Tolerance = 0.0
    sla_tolerance_high: _Tolerance = 0.5
    # Engine-side time to first token above this is a latency breach for AIMD.
    ttft_slo_ms: _Ms = 2000.0
    # AIMD bounds per engine (max: --max-concurrency) and where a new engine's limit starts
    # (0 = max). From 8, the limit grows by half per scrape while the engine runs all it
    # is sent and work waits (slow start: 8 -> 32 in four scrapes), so a cold flood
    # overfills an engine whose batch is smaller than the maximum by a few requests, not
    # by the difference, before its learned batch bounds it.
    aimd_min: _Concurrency = 1
    aimd_max: _Concurrency = 32
    aimd_initial: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 8
    oom_cooldown_ms: _MsOrOff = 10000.0
    # Weight of a new sample in the online estimators (EWMA).
    ewma_alpha: _Fraction = 0.2
    # Housekeeping tick while anything is queued: TTL, aging, hopeless requests.
    tick_ms: Annotated[float, msgspec.Meta(ge=1, le=60_000)] = 20.0
    # Latency samples kept for the percentiles of stats().
    latency_window: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 2048

    @classmethod
    def from_settings(cls, settings: Any) -> "AdmissionSettings":
        """Build from the top-level Settings (duck-typed: bands, sla_ms,
        max_concurrency, admission mapping). Unknown admission keys are an error."""
        extra = dict(getattr(settings, "admission", None) or {})
        bands = getattr(settings, "bands", None)
        if bands and "bands" not in extra:
            extra["bands"] = [b if isinstance(b, dict) else msgspec.structs.asdict(b) for b in bands]
        if "sla_ms" not in extra and getattr(settings, "sla_ms", None):
            extra["sla_ms"] = settings.sla_ms
        if "aimd_max" not in extra and getattr(settings, "max_concurrency", None):
            extra["aimd_max"] = settings.max_concurrency
        try:
            out = msgspec.convert(extra, cls)
        except msgspec.ValidationError as e:
            raise AdmissionConfigError(f"admission: {e}") from None
        return out.validate()

    def validate(self) -> "AdmissionSettings":
        """Check the values; raise AdmissionConfigError naming the bad key."""
        try:  # the ranges, also of an instance built directly rather than converted
            msgspec.convert(msgspec.to_builtins(self), type(self))
        except msgspec.ValidationError as e:
            raise AdmissionConfigError(f"admission: {e}") from None
        if not self.bands:
            raise AdmissionConfigError("bands: at least one band is needed")
        names = [b.name for b in self.bands]
        if len(set(names)) != len(names):
            raise AdmissionConfigError(f"bands: duplicate band names in {names}")
        # The ranges of single values are checked by msgspec (the Meta of each field); what
        # is left are the relations between values.
        for i, b in enumerate(self.bands):
            if i and b.ceiling > self.bands[i - 1].ceiling:
                prev = self.bands[i - 1]
                raise AdmissionConfigError(
                    f"bands[{i}].ceiling: band {b.name!r} has ceiling {b.ceiling}, above "
                    f"{prev.ceiling} of the higher-priority band {prev.name!r}; ceilings must "
                    "not rise as priority falls"
                )
        if self.default_band not in names:
            # A config with its own band names and no "normal": the middle band.
            self.default_band = names[len(names) // 2]
        if self.fairness not in ("rr", "tokens", "locality"):
            raise AdmissionConfigError(f"admission.fairness: 'rr', 'tokens' or 'locality', not {self.fairness!r}")
        for i, b in enumerate(self.bands):
            if b.fairness is not None and b.fairness not in ("rr", "tokens", "locality"):
                raise AdmissionConfigError(
                    f"bands[{i}].fairness: 'rr', 'tokens' or 'locality' (or null), not {b.fairness!r}"
                )
        if self.fairness_charge not in ("actual", "estimate"):
            raise AdmissionConfigError(
                f"admission.fairness_charge: 'actual' or 'estimate', not {self.fairness_charge!r}"
            )
        if self.aimd_min > self.aimd_max:
            raise AdmissionConfigError(
                f"admission.aimd_min: {self.aimd_min} is above aimd_max (max_concurrency) {self.aimd_max}"
            )
        return self
