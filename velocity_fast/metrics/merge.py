"""Several processes' Prometheus text as one's: the workers of one gateway, merged for its
admin port.

Each family is merged by the rule its metric declared where it was registered
(``Registry.counter(..., merge=SUM)`` and the like, metrics/registry.py), which the
exposition carries as a ``# MERGE name rule`` line (``Registry.render(merge_rules=True)``):
nothing here names a metric. A family that declares no rule is summed (counters and
histograms add up so). The merged text has no ``# MERGE`` lines.
"""

from __future__ import annotations

from .registry import MAX, MEAN, MIN, format_value

__all__ = ["merge_metrics"]


class _Family:
    __slots__ = ("name", "help", "kind", "rule", "samples", "seen")

    def __init__(self, name: str) -> None:
        self.name = name
        self.help = ""
        self.kind = "untyped"
        self.rule: str | None = None
        self.samples: dict[str, float] = {}  # sample (name and labels) -> value
        self.seen: dict[str, int] = {}  # sample -> processes that reported it


def _family(families: dict[str, _Family], name: str) -> _Family:
    fam = families.get(name)
    if fam is None:
        fam = families[name] = _Family(name)
    return fam


def _parse(text: str, families: dict[str, _Family]) -> None:
    """Add one process's text to ``families``; a family's rule is the first one declared
    (it precedes its samples)."""
    fam: _Family | None = None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE", "MERGE"):
                fam = _family(families, parts[2])
                rest = parts[3] if len(parts) > 3 else ""
                if parts[1] == "HELP":
                    fam.help = rest
                elif parts[1] == "TYPE":
                    fam.kind = rest or "untyped"
                elif fam.rule is None and rest:
                    fam.rule = rest
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        if fam is None or not key.startswith(fam.name):
            fam = _family(families, key.split("{", 1)[0])
        old = fam.samples.get(key)
        if old is None:
            fam.samples[key] = v
        elif fam.rule == MAX:
            fam.samples[key] = max(old, v)
        elif fam.rule == MIN:
            fam.samples[key] = min(old, v)
        else:  # sum, mean (divided at the end), ratio (recomputed at the end)
            fam.samples[key] = old + v
        fam.seen[key] = fam.seen.get(key, 0) + 1


def merge_metrics(texts: list[str]) -> str:
    """The Prometheus text of several processes as one's, each family by its declared rule."""
    families: dict[str, _Family] = {}
    for text in texts:
        _parse(text, families)
    out: list[str] = []
    for fam in families.values():
        rule = fam.rule or ""
        if rule == MEAN:
            for key in fam.samples:
                fam.samples[key] /= fam.seen[key]
        elif rule.startswith("ratio "):
            num, den = (families.get(n) for n in rule.split(" ")[1:3])
            top = sum(num.samples.values()) if num else 0.0
            bottom = sum(den.samples.values()) if den else 0.0
            for key in fam.samples:
                fam.samples[key] = top / bottom if bottom else 0.0
        if fam.help:
            out.append(f"# HELP {fam.name} {fam.help}")
        out.append(f"# TYPE {fam.name} {fam.kind}")
        for key, v in fam.samples.items():
            out.append(f"{key} {format_value(v)}")
    return "\n".join(out) + "\n" if out else ""
