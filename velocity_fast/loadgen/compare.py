"""Policy comparison: medians over repeated runs and the one table that shows them."""
from __future__ import annotations

import math
import statistics

# (column title, path into a run summary, format)
COLUMNS = (
    ("goodput req/s", ("goodput_rps",), "{:.2f}"),
    ("in SLA %", ("goodput_ratio",), "pct"),
    ("thruput req/s", ("throughput_rps",), "{:.2f}"),
    ("completed", ("completed",), "{:.0f}"),
    ("rejected", ("failed",), "{:.0f}"),
    ("p50 ms", ("latency_ms", "p50"), "{:.0f}"),
    ("p90 ms", ("latency_ms", "p90"), "{:.0f}"),
    ("p99 ms", ("latency_ms", "p99"), "{:.0f}"),
    ("TTFT p50 ms", ("ttft_ms", "p50"), "{:.0f}"),
    ("TTFT p99 ms", ("ttft_ms", "p99"), "{:.0f}"),
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
        for title, path, _ in COLUMNS:
            vals = [x for x in (_get(s, path) for s in summaries) if not math.isnan(x)]
            row[title] = statistics.median(vals) if vals else math.nan
        out[policy] = row
    return out


def format_table(meds: dict[str, dict[str, float]], order: list[str]) -> str:
    """A plain-text table, one row a policy, aligned for a terminal or a log."""
    header = ["policy", "runs"] + [c[0] for c in COLUMNS]
    rows = []
    for policy in order:
        if policy not in meds:
            continue
        m = meds[policy]
        cells = [policy, str(m["runs"])]
        for title, _, fmt in COLUMNS:
            v = m[title]
            cells.append("-" if math.isnan(v) else (f"{100 * v:.1f}" if fmt == "pct" else fmt.format(v)))
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
    return "\n".join(lines)


def verdict(meds: dict[str, dict[str, float]], baseline: str = "static") -> list[str]:
    """One line per policy saying its goodput against the baseline's."""
    if baseline not in meds:
        return []
    base = meds[baseline]["goodput req/s"]
    lines = []
    for policy, m in meds.items():
        if policy == baseline:
            continue
        g = m["goodput req/s"]
        if base > 0:
            lines.append(f"{policy}: goodput {g:.2f} req/s vs {baseline} {base:.2f} ({100 * (g / base - 1):+.0f}%)")
        else:
            lines.append(f"{policy}: goodput {g:.2f} req/s vs {baseline} {base:.2f}")
    return lines
