"""Policy objects: small pieces behind narrow interfaces, composed per policy.

* Fairness between tenants of a band: ``RoundRobin`` (by turns) or ``TokenWeighted``
  (virtual token counter). Interface: ``token_fair`` for the compiled queues. Either
  way a tenant's configured ``weight`` is its share (``Policy.weights``).
* Ordering within a tenant: ``Fifo`` or ``EarliestDeadline``. Interface: ``edf``
  for the compiled queues and ``key(item)``, the order it promises.
* Saturation of a pool: ``FixedConcurrency`` (limits only, the baseline) or
  ``EngineSaturation`` (engine metrics with both lags closed). Interface:
  ``pool(loads, pending, now) -> float`` and ``endpoint(load, now) -> float``.

A ``Policy`` composes them with the switches of admission (docs/design.md): ``static``
(fixed concurrency, FIFO, one band, no SLA rejection), ``dynamic`` (bands,
saturation, SLA-aware 429, AIMD, OOM throttle) and ``smart`` (dynamic + EDF within a
tenant + hopeless-request dropping).
"""

from __future__ import annotations

import math

from velocity_fast.admission.bands import BandQueues
from velocity_fast.admission.saturation import Saturation
from velocity_fast.admission.settings import POLICIES, AdmissionSettings, BandSettings

__all__ = [
    "RoundRobin",
    "TokenWeighted",
    "Locality",
    "Fifo",
    "EarliestDeadline",
    "FixedConcurrency",
    "EngineSaturation",
    "Policy",
    "make_policy",
]


class RoundRobin:
    """Between tenants by turns: one slot per tenant per rotation."""

    name = "rr"
    token_fair = False


class TokenWeighted:
    """Between tenants by virtual token counter: least-served tenant goes next."""

    name = "tokens"
    token_fair = True


class Locality:
    """Between tenants by virtual token counter, and among those within
    ``fairness_locality_bound`` of the least-served one, the request whose prefix an
    engine with room holds goes first."""

    name = "locality"
    token_fair = True


class Fifo:
    """Within a tenant: arrival order."""

    name = "fifo"
    edf = False

    @staticmethod
    def key(item) -> tuple:
        """The order promised within a tenant."""
        return (item.enqueued_at, item.id)


class EarliestDeadline:
    """Within a tenant: earliest deadline first, arrival order on ties."""

    name = "edf"
    edf = True

    @staticmethod
    def key(item) -> tuple:
        """The order promised within a tenant."""
        return (item.deadline, item.id)


class FixedConcurrency:
    """The baseline: no notion of engine saturation, only per-engine limits."""

    name = "fixed"

    def pool(self, loads, pending: float, now: float) -> float:
        """Always 0 unless no endpoint is healthy (then infinity)."""
        return 0.0 if any(e.healthy for e in loads) else math.inf

    def endpoint(self, load, now: float) -> float:
        """Always 0."""
        return 0.0


class EngineSaturation:
    """Saturation from the engines' metrics (see admission/saturation.pyx)."""

    name = "engine"

    def __init__(self, queue_threshold: float = 5.0, kv_threshold: float = 0.8, stale_after_s: float = 1.0) -> None:
        self.model = Saturation(queue_threshold, kv_threshold, stale_after_s)
        self.pool = self.model.pool

    def endpoint(self, load, now: float) -> float:
        """One endpoint's number (no outstanding leases on top)."""
        return self.model.endpoint(load, now, 0.0)


class Policy:
    """One named combination of the pieces above plus the behaviour switches."""

    def __init__(
        self,
        name: str,
        *,
        bands: list[BandSettings],
        fairness,
        ordering,
        saturation,
        adaptive: bool,
        sla_reject: bool,
        drop_hopeless: bool,
        oom_throttle: bool,
        aging_step_s: float,
        weights: dict[str, float] | None = None,
    ) -> None:
        self.name = name
        self.bands = bands
        self.fairness = fairness
        self.ordering = ordering
        self.saturation = saturation
        self.adaptive = adaptive
        self.sla_reject = sla_reject
        self.drop_hopeless = drop_hopeless
        self.oom_throttle = oom_throttle
        self.aging_step_s = aging_step_s
        # Tenant name -> its share in fairness (absent: 1), from the tenants' `weight`.
        self.weights = dict(weights or {})

    def band_fairness(self, settings: AdmissionSettings) -> list[str]:
        """Per band its fairness: the band's own ``fairness``, else the policy's."""
        return [getattr(b, "fairness", None) or self.fairness.name for b in self.bands]

    @property
    def counts_tokens(self) -> bool:
        """Some band serves its tenants by token counter (tokens or locality)."""
        return self.fairness.token_fair or any(
            getattr(b, "fairness", None) in ("tokens", "locality") for b in self.bands
        )

    @property
    def single_band(self) -> bool:
        """True when every request lands in one band (the static baseline)."""
        return len(self.bands) == 1

    def make_queues(self, settings: AdmissionSettings) -> BandQueues:
        """Fresh compiled queues configured for this policy."""
        specs = [(b.queue_capacity, b.queue_bytes, b.ttl_ms / 1000.0) for b in self.bands]
        return BandQueues(
            specs,
            settings.global_capacity,
            settings.global_bytes,
            self.ordering.edf,
            self.fairness.token_fair,
            self.aging_step_s,
            self.weights,
            settings.fairness_output_weight,
            self.band_fairness(settings),
            settings.fairness_locality_bound,
        )

    def __repr__(self) -> str:
        return (
            f"Policy({self.name}: {self.fairness.name}/{self.ordering.name}/"
            f"{self.saturation.name}, bands={[b.name for b in self.bands]})"
        )


def _fairness(settings: AdmissionSettings):
    return {"tokens": TokenWeighted, "locality": Locality}.get(settings.fairness, RoundRobin)()


def make_policy(name: str, settings: AdmissionSettings, weights: dict[str, float] | None = None) -> Policy:
    """The policy ``static``, ``dynamic`` or ``smart`` for these settings; ``weights``:
    tenant name -> its share in fairness (a tenant not named has 1)."""
    if name not in POLICIES:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, not {name!r}")
    if name == "static":
        # One band that holds what all bands would, with the longest TTL: the
        # baseline queues everything in arrival order and never holds work back.
        one = BandSettings(
            name="all",
            ceiling=math.inf,
            queue_capacity=sum(b.queue_capacity for b in settings.bands),
            queue_bytes=sum(b.queue_bytes for b in settings.bands) if all(b.queue_bytes for b in settings.bands) else 0,
            ttl_ms=max(b.ttl_ms for b in settings.bands),
        )
        return Policy(
            "static",
            bands=[one],
            fairness=_fairness(settings),
            ordering=Fifo(),
            saturation=FixedConcurrency(),
            adaptive=False,
            sla_reject=False,
            drop_hopeless=False,
            oom_throttle=False,
            aging_step_s=0.0,
            weights=weights,
        )
    sat = EngineSaturation(settings.queue_threshold, settings.kv_threshold, settings.stale_after_ms / 1000.0)
    return Policy(
        name,
        bands=list(settings.bands),
        fairness=_fairness(settings),
        ordering=EarliestDeadline() if name == "smart" else Fifo(),
        saturation=sat,
        # docs/design.md, "Admission" puts declining queued requests that can no longer meet
        # their deadline under SLA-aware admission, which both policies do.
        adaptive=True,
        sla_reject=True,
        drop_hopeless=True,
        oom_throttle=True,
        aging_step_s=settings.aging_step_ms / 1000.0,
        weights=weights,
    )
