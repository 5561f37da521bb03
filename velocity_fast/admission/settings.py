"""Admission settings: msgspec Structs with validation (defaults live here).

``AdmissionSettings.from_settings(settings)`` builds them from the top-level
configuration (its ``bands``, ``sla_ms``, ``max_concurrency`` and the free-form
``admission:`` mapping), so the YAML keys under ``admission:`` are these field names.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from .errors import AdmissionConfigError

__all__ = ["BandSettings", "AdmissionSettings", "POLICIES"]

POLICIES = ("static", "dynamic", "smart")



class BandSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One priority band. ``queue_bytes`` 0 = no byte limit; ``ttl_ms`` 0 = no TTL.

    ``sla_ms``: the deadline of this band's requests that name none of their own (nor
    their tenant); None: the server's ``sla_ms``; 0: none. A request without a deadline
    is never declined on a prediction: it waits its turn and fills what the engines run
    up to the band's ceiling (batch work is judged by throughput, not by a deadline)."""

    name: str
    ceiling: float
    queue_capacity: int = 1000
    queue_bytes: int = 0
    ttl_ms: float = 30000.0
    sla_ms: float | None = None
    # The ceiling on what the gateway only guesses of an engine (None: the ceiling): its KV
    # use, which grows as the requests running decode, and its concurrency limit while it
    # stands in for a batch not yet learned. Batch work fills all of a learned batch but a
    # slot (0.95), and 0.7 of a guess: a guess overfills the engine's own FIFO queue, where
    # priorities no longer apply (an engine bound by its KV blocks never shows its batch).
    soft_ceiling: float | None = None


def _default_bands() -> list[BandSettings]:
    return [
        BandSettings(name="high", ceiling=1.5, queue_capacity=1000, ttl_ms=60000.0),
        BandSettings(name="normal", ceiling=1.0, queue_capacity=1000, ttl_ms=30000.0),
        # Batch work: no deadline, and all of each engine's batch but a slot or a
        # twentieth, whichever is more, kept for higher bands.
        BandSettings(name="low", ceiling=0.95, queue_capacity=5000, ttl_ms=120000.0, sla_ms=0.0,
                     soft_ceiling=0.7),
    ]


class AdmissionSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything admission needs to know; times in milliseconds unless named _s."""

    bands: list[BandSettings] = msgspec.field(default_factory=_default_bands)
    # The band of a request that names none (or names one that does not exist).
    default_band: str = "normal"
    # Across all bands and pools: 0 = no limit.
    global_capacity: int = 10000
    global_bytes: int = 0
    # Saturation thresholds (docs/design.md, "Admission") and when a scrape counts as stale.
    queue_threshold: float = 5.0
    kv_threshold: float = 0.8
    # KV above this on a scrape is a breach for AIMD (x0.75).
    kv_hard_limit: float = 0.95
    stale_after_ms: float = 1000.0
    # Anti-starvation: a waiting request rises one band per step (0 = off). A
    # backstop, not a scheduler: a short step would let a deep low backlog rise
    # into the headroom kept for higher bands.
    aging_step_ms: float = 30000.0
    # Between tenants: "rr" (turns) or "tokens" (virtual token counter).
    fairness: str = "rr"
    # The server's SLA: the deadline of every request that names none of its own (nor
    # its tenant): predicted, declined early (429 sla), judged for compliance and AIMD.
    sla_ms: float = 3000.0
    # A prediction may exceed the deadline by this fraction before 429 (high: more).
    # 0 keeps the promise that what is admitted finishes within its SLA (the queue model
    # is the engines' own measured pace); high trades that for fewer declines.
    sla_tolerance: float = 0.0
    sla_tolerance_high: float = 0.5
    # Engine-side time to first token above this is a latency breach for AIMD.
    ttft_slo_ms: float = 2000.0
    # AIMD bounds per engine (max: --max-concurrency) and where a new engine's limit starts
    # (0 = max). From 8, the limit grows by half per scrape while the engine runs all it
    # is sent and work waits (slow start: 8 -> 32 in four scrapes), so a cold flood
    # overfills an engine whose batch is smaller than the maximum by a few requests, not
    # by the difference, before its learned batch bounds it.
    aimd_min: int = 1
    aimd_max: int = 32
    aimd_initial: int = 8
    oom_cooldown_ms: float = 10000.0
    # Weight of a new sample in the online estimators (EWMA).
    ewma_alpha: float = 0.2
    # Housekeeping tick while anything is queued: TTL, aging, hopeless requests.
    tick_ms: float = 20.0
    # Latency samples kept for the percentiles of stats().
    latency_window: int = 2048

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
        if not self.bands:
            raise AdmissionConfigError("bands: at least one band is needed")
        names = [b.name for b in self.bands]
        if len(set(names)) != len(names):
            raise AdmissionConfigError(f"bands: duplicate band names in {names}")
        for i, b in enumerate(self.bands):
            if not b.ceiling > 0:
                raise AdmissionConfigError(f"bands[{i}].ceiling: band {b.name!r} needs a positive ceiling")
            if i and b.ceiling > self.bands[i - 1].ceiling:
                prev = self.bands[i - 1]
                raise AdmissionConfigError(
                    f"bands[{i}].ceiling: band {b.name!r} has ceiling {b.ceiling}, above "
                    f"{prev.ceiling} of the higher-priority band {prev.name!r}; ceilings must "
                    "not rise as priority falls")
            if b.queue_capacity < 0 or b.queue_bytes < 0 or b.ttl_ms < 0:
                raise AdmissionConfigError(
                    f"bands[{i}]: queue_capacity, queue_bytes and ttl_ms of band {b.name!r} must be >= 0")
            if b.soft_ceiling is not None and not b.soft_ceiling > 0:
                raise AdmissionConfigError(f"bands[{i}].soft_ceiling: band {b.name!r} needs a positive value")
            if b.sla_ms is not None and not 0 <= b.sla_ms < math.inf:
                raise AdmissionConfigError(
                    f"bands[{i}].sla_ms: band {b.name!r} needs a finite number of milliseconds >= 0 "
                    f"(0: no deadline; leave it out for the server's), got {b.sla_ms}")
        if self.default_band not in names:
            # A config with its own band names and no "normal": the middle band.
            self.default_band = names[len(names) // 2]
        if self.fairness not in ("rr", "tokens"):
            raise AdmissionConfigError(f"admission.fairness: 'rr' or 'tokens', not {self.fairness!r}")
        if not (self.queue_threshold > 0 and self.kv_threshold > 0):
            raise AdmissionConfigError("admission.queue_threshold/kv_threshold: must be positive")
        if not 1 <= self.aimd_min <= self.aimd_max:
            raise AdmissionConfigError(
                f"admission.aimd_min/aimd_max: need 1 <= min <= max, got {self.aimd_min}..{self.aimd_max}")
        if not 0 < self.ewma_alpha <= 1:
            raise AdmissionConfigError(f"admission.ewma_alpha: in (0, 1], got {self.ewma_alpha}")
        for key in ("sla_ms", "tick_ms", "ttft_slo_ms"):
            if not getattr(self, key) > 0:
                raise AdmissionConfigError(f"admission.{key}: must be positive")
        if self.latency_window < 1:
            raise AdmissionConfigError("admission.latency_window: must be at least 1")
        return self
