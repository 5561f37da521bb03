"""Several workers' /stats as one gateway's (gateway/workers.py answers the admin port with it)."""

from __future__ import annotations

from typing import Any

__all__ = ["STATS_MAX_KEYS", "merge_stats"]

# /stats: numbers under these keys (at any depth) are every worker's view of the whole
# gateway (shared memory, the engines' scrapes, the settings): the largest is taken, not
# the sum. Everything else that is a number is summed.
STATS_MAX_KEYS = frozenset({
    "uptime_seconds", "inflight", "limit", "running", "waiting", "kv_usage", "metrics_age_s", "num_gpu_blocks",
    "saturation", "batch_capacity", "running_max", "others", "frozen", "overload_s", "ceiling", "oldest_wait_ms",
    "wait_ms", "estimates", "counter", "pending", "lifted", "quota_tokens_left", "weight", "requests_per_second", "tokens_per_minute",
    "healthy_endpoints", "endpoints_total", "kv_events",
})


def _merge_value(a: Any, b: Any, take_max: bool) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) or bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b) if take_max else a + b
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge_value(out.get(k), v, take_max or k in STATS_MAX_KEYS)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, dict) and "name" in x for x in a + b):
            by_name: dict[str, dict] = {}
            for x in a + b:
                by_name[x["name"]] = _merge_value(by_name.get(x["name"]), x, take_max)
            return list(by_name.values())
        out_list = list(a)
        for x in b:
            if x not in out_list:
                out_list.append(x)
        return out_list
    return a  # a word (the policy, a state): the first worker's


def merge_stats(stats: list[dict]) -> dict:
    """Several workers' /stats as one gateway's: numbers at the same path summed (the
    largest under ``STATS_MAX_KEYS``), lists of named things merged by name."""
    out: dict = {}
    for s in stats:
        out = _merge_value(out, s, False)
    return out
