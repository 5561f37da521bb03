"""Printing a run summary and writing it as JSON (summary) and CSV (one row a request)."""

from __future__ import annotations

import csv
import math
from typing import TextIO

import orjson

CSV_FIELDS = (
    "index",
    "arrival_s",
    "sent_s",
    "band",
    "tenant",
    "stream",
    "prompt_tokens",
    "max_tokens",
    "prefix_group",
    "sla_ms",
    "status",
    "reason",
    "endpoint",
    "latency_ms",
    "ttft_ms",
    "mean_itl_ms",
    "output_tokens",
    "good",
)


def _f(x: float, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_summary(s: dict) -> str:
    """A short human-readable report of one run."""
    lines = [
        f"requests {s['requests']}  completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.2f} s",
        f"throughput {s['throughput_rps']:.2f} req/s   goodput {s['goodput_rps']:.2f} req/s "
        f"({100 * s['goodput_ratio']:.1f}% within SLA)   output {s['output_tokens_per_s']:.0f} tok/s",
    ]
    for key, label in (
        ("latency_ms", "latency"),
        ("ttft_ms", "TTFT"),
        ("itl_ms", "ITL"),
        ("client_wait_ms", "client wait"),
    ):
        d = s[key]
        if d["count"]:
            lines.append(
                f"{label + ' ms':<15} p50 {_f(d['p50'])}  p90 {_f(d['p90'])}  "
                f"p95 {_f(d['p95'])}  p99 {_f(d['p99'])}  max {_f(d['max'])}"
            )
    rej = s["rejections"]
    if rej["by_status"]:
        lines.append("not completed by status: " + ", ".join(f"{k}: {v}" for k, v in rej["by_status"].items()))
        lines.append("not completed by reason: " + ", ".join(f"{k}: {v}" for k, v in rej["by_reason"].items()))
        for status, message in rej.get("first_error", {}).items():
            lines.append(f"first error with status {status}: {message}")
    if len(s["by_band"]) > 1:
        for band, b in s["by_band"].items():
            lines.append(
                f"band {band:<8} {b['completed']}/{b['requests']} completed, "
                f"{100 * b['goodput_ratio']:.1f}% within SLA, p50 {_f(b['latency_p50_ms'])} ms, "
                f"p99 {_f(b['latency_p99_ms'])} ms"
            )
    if "client_cpu_us_per_request" in s:
        lines.append(
            f"loadgen cost: {s['client_cpu_us_per_request']:.0f} us CPU per request, "
            f"{100 * s['client_cpu_share']:.0f}% of one core"
        )
        if s["client_cpu_share"] > 0.8:
            lines.append("warning: the load generator used most of a core; it may be the bottleneck")
    if s["client_wait_ms"]["count"] and s["client_wait_ms"]["p99"] > 50:
        lines.append(
            "warning: requests waited in the client for --concurrency; raise it to "
            "measure the server's queueing rather than the client's"
        )
    return "\n".join(lines)


def plain_args(args) -> dict:
    """The flags of a run as JSON-safe values (anything else an argparse tree may carry
    is left out)."""
    return {k: v for k, v in vars(args).items() if v is None or isinstance(v, (str, int, float, bool, list))}


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as indented JSON (NaN becomes null)."""
    with open(path, "wb") as f:
        f.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def request_rows(specs, results, start: float):
    """One dict per request, with the CSV_FIELDS keys."""
    for s, r in zip(specs, results):
        lat = (r.done - r.sent) * 1000.0
        yield {
            "index": s.index,
            "arrival_s": round(s.at, 6),
            "sent_s": round(r.sent - start, 6),
            "band": s.band,
            "tenant": s.tenant,
            "stream": int(s.stream),
            "prompt_tokens": s.prompt_tokens,
            "max_tokens": s.max_tokens,
            "prefix_group": s.prefix_group,
            "sla_ms": s.sla_ms,
            "status": r.status,
            "reason": r.reason,
            "endpoint": r.endpoint,
            "latency_ms": round(lat, 3),
            "ttft_ms": round((r.first_token - r.sent) * 1000.0, 3) if r.first_token is not None else "",
            "mean_itl_ms": round(sum(r.gaps) / len(r.gaps) * 1000.0, 3) if r.gaps else "",
            "output_tokens": r.output_tokens,
            "good": int(r.ok and lat <= s.sla_ms),
        }


def write_csv(path: str, rows, fields=CSV_FIELDS) -> None:
    """Write dict rows as CSV with a header line."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow(row)


def print_to(stream: TextIO, text: str) -> None:
    """Print and flush (reports may be read by a parent process line by line)."""
    stream.write(text + "\n")
    stream.flush()
