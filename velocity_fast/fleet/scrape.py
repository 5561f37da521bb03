"""Reading an engine's /metrics: only the lines the gateway needs (docs/design.md, "Where each contract lives")."""

from __future__ import annotations

import msgspec

__all__ = ["MetricNames", "EngineMetrics", "parse_engine_metrics", "pace_between"]


class MetricNames(msgspec.Struct, forbid_unknown_fields=True):
    """Names to read, each with alternatives (names drift between vLLM versions)."""

    running: list[str] = msgspec.field(default_factory=lambda: ["vllm:num_requests_running"])
    waiting: list[str] = msgspec.field(default_factory=lambda: ["vllm:num_requests_waiting"])
    kv_usage: list[str] = msgspec.field(
        default_factory=lambda: ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
    )
    cache_config: list[str] = msgspec.field(default_factory=lambda: ["vllm:cache_config_info"])
    # The engine's own prefix cache: tokens looked up and tokens found (counters).
    prefix_cache_queries: list[str] = msgspec.field(
        default_factory=lambda: ["vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"]
    )
    prefix_cache_hits: list[str] = msgspec.field(
        default_factory=lambda: ["vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"]
    )
    # The inter-token latency histogram (its _sum and _count): the engine's decode pace.
    inter_token_latency: list[str] = msgspec.field(
        default_factory=lambda: ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"]
    )


class EngineMetrics:
    __slots__ = (
        "running",
        "waiting",
        "kv_usage",
        "block_size",
        "num_gpu_blocks",
        "found",
        "prefix_queries",
        "prefix_hits",
        "itl_sum",
        "itl_count",
    )

    def __init__(self) -> None:
        self.prefix_queries: float | None = None  # the engine's prefix-cache counters, when it has them
        self.prefix_hits: float | None = None
        self.itl_sum: float | None = None  # the inter-token latency histogram's sum and count
        self.itl_count: float | None = None
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.block_size: int | None = None
        self.num_gpu_blocks: int | None = None
        self.found = 0  # how many of running/waiting/kv were present


def _finite(v: float) -> bool:
    return v - v == 0.0


def _label(labels: bytes, name: bytes) -> int | None:
    i = labels.find(name + b'="')
    if i < 0:
        return None
    j = labels.find(b'"', i + len(name) + 2)
    try:
        return int(float(labels[i + len(name) + 2 : j]))
    except ValueError:
        return None


def parse_engine_metrics(text: bytes, names: MetricNames) -> EngineMetrics:
    """Sum each gauge over its label sets (data-parallel ranks); read cache_config_info labels.

    The first name of each list that appears wins, so an engine exposing both an
    old and a new name is not counted twice.
    """
    out = EngineMetrics()
    fields = (
        ("running", [n.encode() for n in names.running]),
        ("waiting", [n.encode() for n in names.waiting]),
        ("kv_usage", [n.encode() for n in names.kv_usage]),
        ("prefix_queries", [n.encode() for n in names.prefix_cache_queries]),
        ("prefix_hits", [n.encode() for n in names.prefix_cache_hits]),
        ("itl_sum", [n.encode() + b"_sum" for n in names.inter_token_latency]),
        ("itl_count", [n.encode() + b"_count" for n in names.inter_token_latency]),
    )
    wanted: dict[bytes, tuple[str, int]] = {}
    for field, alts in fields:
        for rank, n in enumerate(alts):
            wanted[n] = (field, rank)
    cache_names = tuple(n.encode() for n in names.cache_config)
    best: dict[str, int] = {}
    sums: dict[str, float] = {}
    valid: set[str] = set()  # fields with at least one usable sample
    kv_count = 0
    for line in text.split(b"\n"):
        if not line or line[0] == 35:  # '#'
            continue
        brace = line.find(b"{")
        space = line.find(b" ")
        if space < 0:
            continue
        name = line[:brace] if 0 <= brace < space else line[:space]
        hit = wanted.get(name)
        if hit is not None:
            field, rank = hit
            if rank > best.get(field, 1 << 30):
                continue
            if rank < best.get(field, 1 << 30):
                best[field] = rank
                sums[field] = 0.0
                valid.discard(field)
                if field == "kv_usage":
                    kv_count = 0
            # The value is the first field after the labels: a timestamp may follow it.
            end = line.rfind(b"}") + 1 if 0 <= brace < space else len(name)
            rest = line[end:].split(None, 1)
            try:
                value = float(rest[0])
            except (ValueError, IndexError):
                continue
            if not _finite(value):  # NaN or Inf would poison saturation: treat as absent
                continue
            sums[field] += value
            valid.add(field)
            if field == "kv_usage":
                kv_count += 1
        elif name in cache_names and brace >= 0:
            labels = line[brace : line.rfind(b"}") + 1]
            out.block_size = _label(labels, b"block_size")
            out.num_gpu_blocks = _label(labels, b"num_gpu_blocks")
    out.running = sums.get("running", 0.0)
    out.waiting = sums.get("waiting", 0.0)
    # KV usage is a fraction per rank: average, not sum, over data-parallel ranks.
    out.kv_usage = sums.get("kv_usage", 0.0) / kv_count if kv_count else 0.0
    if "prefix_queries" in valid and "prefix_hits" in valid:
        out.prefix_queries, out.prefix_hits = sums["prefix_queries"], sums["prefix_hits"]
    if "itl_sum" in valid and "itl_count" in valid and best["itl_sum"] == best["itl_count"]:
        out.itl_sum, out.itl_count = sums["itl_sum"], sums["itl_count"]
    out.found = len(valid & {"running", "waiting", "kv_usage"})
    return out


def pace_between(before: tuple[float, float] | None, now: tuple[float, float]) -> float:
    """Seconds per output token between two readings of the inter-token latency
    histogram, each (sum, count): the sum's growth over the count's. 0 when unknown: no
    earlier reading, no token in between (nothing ran), or a counter that went back (the
    engine restarted)."""
    if before is None:
        return 0.0
    tokens = now[1] - before[1]
    spent = now[0] - before[0]
    if tokens <= 0 or spent < 0:
        return 0.0
    return spent / tokens
