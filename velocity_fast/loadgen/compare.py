"""Policy comparison: medians over repeated runs and the one table that shows them."""

from __future__ import annotations

import math
import statistics

# (key in the medians, column title, path into a run summary, format)
COLUMNS = (
    ("goodput_ratio", "in SLA %", ("goodput_ratio",), "pct"),
    ("goodput_rps", "goodput req/s", ("goodput_rps",), "{:.2f}"),
    ("throughput_rps", "thruput req/s", ("throughput_rps",), "{:.2f}"),
    ("completed", "completed", ("completed",), "{:.0f}"),
    ("failed", "not done", ("failed",), "{:.0f}"),
    ("admitted_miss_ratio", "admitted late %", ("admitted_miss_ratio",), "pct"),
    ("latency_p50_ms", "p50 ms", ("latency_ms", "p50"), "{:.0f}"),
    ("latency_p90_ms", "p90 ms", ("latency_ms", "p90"), "{:.0f}"),
    ("latency_p99_ms", "p99 ms", ("latency_ms", "p99"), "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50", ("ttft_ms", "p50"), "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99", ("ttft_ms", "p99"), "{:.0f}"),
)


def _get(summary: dict, path: tuple[str, ...]) -> float:
    v = summary
    for k in path:
        v = v.get(k, math.nan) if isinstance(v, dict) else math.nan
    return float(v) if isinstance(v, (int, float)) else math.nan


def medians(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per policy, the median over its runs of every table column (NaNs left out)."""
    by_policy: dict[str, list[dict]] = {}
    for run in runs:
        by_policy.setdefault(run["policy"], []).append(run["summary"])
    out = {}
    for policy, summaries in by_policy.items():
        row = {"runs": len(summaries)}
        for key, _, path, _ in COLUMNS:
            vals = [x for x in (_get(s, path) for s in summaries) if not math.isnan(x)]
            row[key] = statistics.median(vals) if vals else math.nan
        out[policy] = row
    return out


def format_table(meds: dict[str, dict[str, float]], order: list[str]) -> str:
    """A plain-text table, one row a policy, aligned for a terminal or a log."""
    header = ["policy", "runs"] + [c[1] for c in COLUMNS]
    rows = []
    for policy in order:
        if policy not in meds:
            continue
        m = meds[policy]
        cells = [policy, str(m["runs"])]
        for key, _, _, fmt in COLUMNS:
            v = m[key]
            cells.append("-" if math.isnan(v) else (f"{100 * v:.1f}" if fmt == "pct" else fmt.format(v)))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
    return "\n".join(lines)


def verdict(meds: dict[str, dict[str, float]], order: list[str], baseline: str = "static") -> list[str]:
    """One line per policy comparing its goodput with the baseline's.

    The share of requests within SLA is compared, not goodput per second: every policy
    sees the same requests, while a run's length depends on how fast its tail drains.
    """
    if baseline not in meds:
        return []
    base = meds[baseline]
    lines = []
    for policy in order:
        if policy == baseline or policy not in meds:
            continue
        m = meds[policy]
        diff = 100 * (m["goodput_ratio"] - base["goodput_ratio"])
        lines.append(
            f"{policy}: {100 * m['goodput_ratio']:.1f}% of requests within SLA "
            f"({m['goodput_rps']:.2f} req/s) vs {baseline} {100 * base['goodput_ratio']:.1f}% "
            f"({base['goodput_rps']:.2f} req/s): {diff:+.1f} points"
        )
    return lines
