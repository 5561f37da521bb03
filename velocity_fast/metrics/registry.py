"""Prometheus metrics without a dependency.

Values are plain numbers updated in place on the request path (compiled:
metrics/values.pyx); the text format (0.0.4) is produced only when somebody
scrapes. This module is a leaf: it imports nothing of the package but its compiled
values, so the sim engine and the gateway can both use it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

from velocity_fast.metrics.values import HistChild as _HistChild
from velocity_fast.metrics.values import Value as _Value

__all__ = [
    "Registry",
    "Counter",
    "Gauge",
    "Histogram",
    "DEFAULT_BUCKETS",
    "format_value",
    "SUM",
    "MAX",
    "MIN",
    "MEAN",
    "ratio",
    "check_merge",
]

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# How one metric's values from several processes of one gateway (its workers) add up to
# the gateway's: each metric says so where it is registered (``merge=``), and the
# exposition carries it (``render(merge_rules=True)``) to the merge (metrics/merge.py).
SUM = "sum"  # each process counts its own share: its requests, its queues, its index
MAX = "max"  # each process reports the same whole: shared memory, the engines' scrapes, a setting
MIN = "min"  # the same whole, where the smallest is the one to trust
MEAN = "mean"  # a share each process measures alone over its own work
_RULES = frozenset({SUM, MAX, MIN, MEAN})


def ratio(numerator: str, denominator: str) -> str:
    """The rule of a ratio of two summed families: recomputed from their merged totals."""
    return f"ratio {numerator} {denominator}"


def check_merge(rule: str | None) -> str | None:
    """``rule`` if it is one the merge knows (None: not declared); ValueError otherwise."""
    if rule is None or rule in _RULES:
        return rule
    parts = rule.split(" ")
    if len(parts) == 3 and parts[0] == "ratio" and all(parts[1:]):
        return rule
    raise ValueError(f"merge rule {rule!r}: one of {sorted(_RULES)} or ratio(numerator, denominator)")


def format_value(v: float) -> str:
    """A sample's value as the text format writes it (+Inf, NaN, 3.0, 0.25)."""
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if v != v:
        return "NaN"
    if isinstance(v, int) or v.is_integer():
        return f"{float(v):.1f}" if abs(v) < 1e15 else repr(float(v))
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""
    merge: str | None = None  # how the workers' values add up (SUM, MAX, ...); set by Registry

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple, object] = {}
        # The children by the label values as given (the request path reads it: no str() per look-up).
        self.by_values: dict[tuple, object] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()

    def _new_child(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def labels(self, *values):
        """The child for these label values (created on first use)."""
        child = self.by_values.get(values)  # the values as given: no str() per call
        if child is not None:
            return child
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
            child = self._children[key] = self._new_child()
        self.by_values[values] = child
        return child

    def remove(self, *values) -> None:
        key = tuple(str(v) for v in values)
        self._children.pop(key, None)
        self.by_values = {k: c for k, c in self.by_values.items() if tuple(str(v) for v in k) != key}

    def children(self) -> list[tuple[tuple, object]]:
        """Each child with its label values (as text), in the order they were made."""
        return list(self._children.items())

    def _header(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} {self.kind}")


class Counter(_Metric):
    """A monotonically increasing count. The name is used as given (end it in _total)."""

    kind = "counter"

    def _new_child(self) -> _Value:
        return _Value()

    def inc(self, n: float = 1.0) -> None:
        self._children[()].value += n

    def get(self) -> float:
        return self._children[()].value

    def render(self, out: list[str]) -> None:
        self._header(out)
        for key, child in self._children.items():
            out.append(f"{self.name}{_label_text(self.labelnames, key)} {format_value(child.value)}")


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, v: float) -> None:
        self._children[()].value = v

    def dec(self, n: float = 1.0) -> None:
        self._children[()].value -= n


class _FnGauge(_Metric):
    kind = "gauge"

    def __init__(
        self,
        name: str,
        help: str,
        fn: Callable[[], float | Iterable[tuple[tuple, float]]],
        labelnames: Sequence[str] = (),
    ):
        self.fn = fn
        super().__init__(name, help, labelnames)
        self._children.clear()

    def _new_child(self):
        return None

    def render(self, out: list[str]) -> None:
        self._header(out)
        got = self.fn()
        if self.labelnames:
            for key, v in got:
                out.append(f"{self.name}{_label_text(self.labelnames, key)} {format_value(v)}")
        else:
            out.append(f"{self.name} {format_value(got)}")


class _FnCounter(_FnGauge):
    kind = "counter"


class Histogram(_Metric):
    """Cumulative buckets, _sum and _count, as Prometheus expects."""

    kind = "histogram"

    def __init__(
        self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS
    ):
        self.bounds = tuple(sorted(float(b) for b in buckets if b != math.inf))
        super().__init__(name, help, labelnames)

    def _new_child(self) -> _HistChild:
        return _HistChild(self.bounds)

    def observe(self, v: float) -> None:
        self._children[()].observe(v)

    def render(self, out: list[str]) -> None:
        self._header(out)
        for key, child in self._children.items():
            acc = 0
            for bound, n in zip(self.bounds, child.counts):
                acc += n
                le = 'le="' + format_value(bound) + '"'
                out.append(f"{self.name}_bucket{_label_text(self.labelnames, key, le)} {acc}.0")
            inf = _label_text(self.labelnames, key, 'le="+Inf"')
            out.append(f"{self.name}_bucket{inf} {child.count}.0")
            out.append(f"{self.name}_sum{_label_text(self.labelnames, key)} {format_value(child.sum)}")
            out.append(f"{self.name}_count{_label_text(self.labelnames, key)} {child.count}.0")


class Registry:
    """A set of metrics rendered together in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, m: _Metric, merge: str | None) -> _Metric:
        if m.name in self._metrics:
            raise ValueError(f"metric {m.name} registered twice")
        m.merge = check_merge(merge)
        self._metrics[m.name] = m
        return m

    # ``merge``: how several workers' values add up (SUM, MAX, MIN, MEAN, ratio(...)); a
    # gateway's every metric says (a test holds it), a process never merged may leave it.
    def counter(self, name: str, help: str, labelnames: Sequence[str] = (), *, merge: str | None = None) -> Counter:
        return self._add(Counter(name, help, labelnames), merge)  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = (), *, merge: str | None = None) -> Gauge:
        return self._add(Gauge(name, help, labelnames), merge)  # type: ignore[return-value]

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        *,
        merge: str | None = None,
    ) -> Histogram:
        return self._add(Histogram(name, help, labelnames, buckets), merge)  # type: ignore[return-value]

    def gauge_fn(
        self, name: str, help: str, fn: Callable, labelnames: Sequence[str] = (), *, merge: str | None = None
    ) -> None:
        """A gauge computed at scrape time: fn() -> value, or [(label values, value)] with labels."""
        self._add(_FnGauge(name, help, fn, labelnames), merge)

    def counter_fn(
        self, name: str, help: str, fn: Callable, labelnames: Sequence[str] = (), *, merge: str | None = None
    ) -> None:
        """A counter read at scrape time (a count kept elsewhere that only grows), as gauge_fn."""
        self._add(_FnCounter(name, help, fn, labelnames), merge)

    def get(self, name: str) -> _Metric | None:
        return self._metrics.get(name)

    def names(self) -> list[str]:
        return list(self._metrics)

    def render(self, merge_rules: bool = False) -> bytes:
        """The text format; ``merge_rules``: each declared rule too, as a ``# MERGE name rule``
        line before its family (a comment to any other reader of the format)."""
        out: list[str] = []
        for m in self._metrics.values():
            if merge_rules and m.merge is not None:
                out.append(f"# MERGE {m.name} {m.merge}")
            m.render(out)  # type: ignore[attr-defined]
        out.append("")
        return "\n".join(out).encode()
