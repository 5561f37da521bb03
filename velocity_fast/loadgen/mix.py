"""The request mix: bands, tenants, length distributions, shared prefixes, streaming.

A mix comes from a small YAML file (``--mix FILE``) and/or flags; flags win. Every
field is validated by msgspec, so a typo in the file is an error naming the key.

YAML shape (every key optional)::

    bands:   [{name: high, weight: 1, sla_ms: 2000}, {name: low, weight: 3}]
    tenants: [{name: alpha, weight: 1, api_key: key-alpha}, {name: beta, weight: 2}]
    prompt_tokens: {dist: lognormal, value: 200, sigma: 0.6, min: 8, max: 2000}
    output_tokens: {dist: uniform, low: 16, high: 256}
    prefix: {groups: 4, tokens: 512, share: 0.5}
    stream_share: 0.3
    sessions: 0
    clients: {no_max_tokens: 0.3, priority_zero: 0.3, sampling: 0.5}
"""

from __future__ import annotations

import math
import random

import msgspec

DISTRIBUTIONS = ("constant", "uniform", "normal", "lognormal", "exponential")


class Dist(msgspec.Struct, forbid_unknown_fields=True):
    """A length distribution in tokens, clamped to ``[min, max]``.

    ``value`` is the constant, the mean (normal, exponential) or the median
    (lognormal); ``low``/``high`` bound ``uniform``; ``sigma`` is the spread of
    ``normal`` (tokens) and ``lognormal`` (log scale).
    """

    dist: str = "constant"
    value: float = 128.0
    low: float = 0.0
    high: float = 0.0
    sigma: float = 0.0
    min: int = 1
    max: int = 1_000_000

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {self.dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
        if self.dist == "uniform" and self.high < self.low:
            raise ValueError("uniform distribution needs low <= high")
        if self.min < 1 or self.max < self.min:
            raise ValueError("distribution bounds need 1 <= min <= max")

    def sample(self, rng: random.Random) -> int:
        """Draw one length."""
        if self.dist == "constant":
            x = self.value
        elif self.dist == "uniform":
            x = rng.uniform(self.low, self.high)
        elif self.dist == "normal":
            x = rng.gauss(self.value, self.sigma)
        elif self.dist == "lognormal":
            x = rng.lognormvariate(math.log(max(self.value, 1e-9)), self.sigma)
        else:
            x = rng.expovariate(1.0 / max(self.value, 1e-9))
        return max(self.min, min(self.max, int(round(x))))


class Band(msgspec.Struct, forbid_unknown_fields=True):
    """A priority band sent as ``x-velocity-priority``; ``sla_ms`` overrides the global SLA."""

    name: str
    weight: float = 1.0
    sla_ms: float | None = None


class Tenant(msgspec.Struct, forbid_unknown_fields=True):
    """A tenant sent as ``x-velocity-tenant``; its ``api_key`` replaces ``--api-key``."""

    name: str
    weight: float = 1.0
    api_key: str | None = None


class Prefix(msgspec.Struct, forbid_unknown_fields=True):
    """``share`` of the requests start with one of ``groups`` shared prefixes of ``tokens``;
    ``hot`` of those start with the first one (a hot prefix), the rest with one of the
    others at random (with hot 0, any of them at random)."""

    groups: int = 0
    tokens: int = 0
    share: float = 0.0
    hot: float = 0.0


class Clients(msgspec.Struct, forbid_unknown_fields=True):
    """How real OpenAI clients write their bodies, each a share of the requests, drawn on
    its own: ``no_max_tokens`` send no ``max_tokens`` (nor ``ignore_eos``: the engine ends
    the reply where the model does, as most clients leave it); ``priority_zero`` send vLLM's
    default ``"priority": 0`` explicitly, as clients written for vLLM do; ``sampling`` send
    a ``temperature`` and a ``stop`` list. The defaults are the suite's idea of ordinary
    traffic; all 0 sends the plain bodies of a measurement (seeded lengths only)."""

    no_max_tokens: float = 0.3
    priority_zero: float = 0.3
    sampling: float = 0.5


# What a measurement sends when only its seeded lengths may decide the work.
PLAIN_CLIENTS = Clients(no_max_tokens=0.0, priority_zero=0.0, sampling=0.0)


class Mix(msgspec.Struct, forbid_unknown_fields=True):
    """Everything that shapes a request apart from its arrival time."""

    bands: list[Band] = []
    tenants: list[Tenant] = []
    prompt_tokens: Dist = msgspec.field(default_factory=lambda: Dist(value=128))
    output_tokens: Dist = msgspec.field(default_factory=lambda: Dist(value=64))
    prefix: Prefix = msgspec.field(default_factory=Prefix)
    stream_share: float = 0.0
    sessions: int = 0
    clients: Clients = msgspec.field(default_factory=Clients)

    def __post_init__(self) -> None:
        for key in ("no_max_tokens", "priority_zero", "sampling"):
            if not 0.0 <= getattr(self.clients, key) <= 1.0:
                raise ValueError(f"clients.{key} must be within [0, 1]")
        if not 0.0 <= self.stream_share <= 1.0:
            raise ValueError("stream_share must be within [0, 1]")
        if not 0.0 <= self.prefix.share <= 1.0:
            raise ValueError("prefix share must be within [0, 1]")
        if self.prefix.share > 0 and (self.prefix.groups < 1 or self.prefix.tokens < 1):
            raise ValueError("a prefix share needs groups >= 1 and tokens >= 1")
        if not 0.0 <= self.prefix.hot <= 1.0 or (self.prefix.hot > 0 and self.prefix.groups < 2):
            raise ValueError("prefix hot must be within [0, 1], and a hot prefix needs groups >= 2")
        for items, what in ((self.bands, "band"), (self.tenants, "tenant")):
            if any(x.weight < 0 for x in items) or (items and sum(x.weight for x in items) <= 0):
                raise ValueError(f"{what} weights must be >= 0 with a positive sum")


def parse_dist(text: str) -> Dist:
    """Parse a flag such as ``constant:128``, ``uniform:64:512``, ``normal:256:64``,
    ``lognormal:200:0.6`` or ``exponential:128``; a bare number means constant."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            return Dist(value=float(parts[0]))
        kind, nums = parts[0], [float(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"bad distribution {text!r}") from None
    if kind == "uniform" and len(nums) == 2:
        return Dist(dist=kind, low=nums[0], high=nums[1], value=(nums[0] + nums[1]) / 2)
    if kind in ("normal", "lognormal") and len(nums) == 2:
        return Dist(dist=kind, value=nums[0], sigma=nums[1])
    if kind in ("constant", "exponential") and len(nums) == 1:
        return Dist(dist=kind, value=nums[0])
    raise ValueError(f"bad distribution {text!r}")


def _parse_weighted(text: str) -> list[tuple[str, float, float | None]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        try:
            weight = float(parts[1]) if len(parts) > 1 and parts[1] else 1.0
            sla = float(parts[2]) if len(parts) > 2 else None
        except ValueError:
            raise ValueError(f"bad weighted item {item!r} (want name[:weight[:sla_ms]])") from None
        out.append((parts[0], weight, sla))
    return out


def parse_bands(text: str) -> list[Band]:
    """Parse ``high:1:2000,normal:3,low:6`` (name, weight, optional SLA in ms)."""
    return [Band(name=n, weight=w, sla_ms=s) for n, w, s in _parse_weighted(text)]


def parse_tenants(text: str) -> list[Tenant]:
    """Parse ``alpha:1,beta:2`` (name, weight)."""
    return [Tenant(name=n, weight=w) for n, w, _ in _parse_weighted(text)]


def _normalise(raw: dict) -> dict:
    # The mapping form {high: 1, low: 3} is the natural way to write weights by hand.
    for key in ("bands", "tenants"):
        if isinstance(raw.get(key), dict):
            raw[key] = [{"name": k, "weight": v} for k, v in raw[key].items()]
    return raw


def load_mix(path: str) -> Mix:
    """Read and validate a mix YAML file."""
    import yaml

    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a mix file must be a mapping")
    try:
        return msgspec.convert(_normalise(raw), Mix)
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def mix_from_args(args) -> Mix:
    """Build the mix from ``--mix`` (if any) with the mix flags laid over it."""
    mix = load_mix(args.mix) if getattr(args, "mix", None) else Mix()
    changes = {}
    if getattr(args, "bands", None):
        changes["bands"] = parse_bands(args.bands)
    if getattr(args, "tenants", None):
        changes["tenants"] = parse_tenants(args.tenants)
    if getattr(args, "prompt_tokens", None):
        changes["prompt_tokens"] = parse_dist(args.prompt_tokens)
    if getattr(args, "output_tokens", None):
        changes["output_tokens"] = parse_dist(args.output_tokens)
    if getattr(args, "stream", False):
        changes["stream_share"] = 1.0
    elif getattr(args, "stream_share", None) is not None:
        changes["stream_share"] = args.stream_share
    if getattr(args, "sessions", None) is not None:
        changes["sessions"] = args.sessions
    cchanges = {
        k: getattr(args, f"{k}_share")
        for k in ("no_max_tokens", "priority_zero", "sampling")
        if getattr(args, f"{k}_share", None) is not None
    }
    if cchanges:
        changes["clients"] = msgspec.structs.replace(mix.clients, **cchanges)
    prefix = mix.prefix
    pchanges = {
        k: getattr(args, f"prefix_{k}")
        for k in ("groups", "tokens", "share")
        if getattr(args, f"prefix_{k}", None) is not None
    }
    if pchanges:
        changes["prefix"] = msgspec.structs.replace(prefix, **pchanges)
    if not changes:
        return mix
    # replace() skips __post_init__, so re-validate by converting the merged mapping.
    merged = msgspec.structs.replace(mix, **changes)
    return msgspec.convert(msgspec.to_builtins(merged), Mix)
