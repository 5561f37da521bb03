"""The sim engine's /metrics: vLLM's names, labels ``model_name`` and ``engine="0"``, and
vLLM's histogram buckets (vllm/v1/metrics/loggers.py).

Hot counters are plain attributes bumped by the step loop and copied into the
registry only when somebody scrapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from velocity_fast.metrics.registry import Registry

if TYPE_CHECKING:
    from .engine import Engine, Sequence
    from .settings import SimConfig

LABELS = ("model_name", "engine")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM's build_1_2_5_buckets."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return tuple(out)
            out.append(v)
        exp += 1


class SimMetrics:
    """vLLM's metrics of one engine, rendered with the package's Registry."""

    def __init__(self, cfg: "SimConfig") -> None:
        self.cfg = cfg
        key = (cfg.model, "0")
        self.key = key
        reg = self.registry = Registry()
        self._engine: Engine | None = None
        reg.gauge_fn(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda: [(key, len(self._engine.running))],
            LABELS,
        )
        reg.gauge_fn(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda: [(key, len(self._engine.waiting))],
            LABELS,
        )
        reg.gauge_fn(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda: [(key, self._engine.kv.usage)],
            LABELS,
        )
        info = reg.gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"),
        )
        info.labels(cfg.block_size, str(cfg.enable_prefix_caching), "0", cfg.num_gpu_blocks).set(1)
        self._queries = reg.counter(
            "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", LABELS
        ).labels(*key)
        self._hits = reg.counter(
            "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", LABELS
        ).labels(*key)
        self._preemptions = reg.counter(
            "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", LABELS
        ).labels(*key)
        self._prompt_tokens = reg.counter(
            "vllm:prompt_tokens_total", "Number of prefill tokens processed.", LABELS
        ).labels(*key)
        self._generation_tokens = reg.counter(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", LABELS
        ).labels(*key)
        success = reg.counter(
            "vllm:request_success_total", "Count of successfully processed requests.", LABELS + ("finished_reason",)
        )
        self._success = {r: success.labels(cfg.model, "0", r) for r in FINISH_REASONS}
        self._ttft = reg.histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LABELS, TTFT_BUCKETS
        ).labels(*key)
        itl = reg.histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", LABELS, ITL_BUCKETS
        ).labels(*key)
        #: Called once per decoded token by the step loop: the bound method, no lookups.
        self.itl_observe = itl.observe
        self._e2e = reg.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            REQUEST_LATENCY_BUCKETS,
        ).labels(*key)
        self._queue = reg.histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LABELS,
            REQUEST_LATENCY_BUCKETS,
        ).labels(*key)
        len_buckets = buckets_1_2_5(cfg.max_model_len)
        self._req_prompt = reg.histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS, len_buckets
        ).labels(*key)
        self._req_gen = reg.histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", LABELS, len_buckets
        ).labels(*key)
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.preemptions = 0

    def bind(self, engine: "Engine") -> None:
        """Attach the engine whose queues and KV pool the gauges read."""
        self._engine = engine

    # -- events from the step loop ---------------------------------------------
    def scheduled(self, seq: "Sequence", now: float) -> None:
        """The sequence left the waiting queue for the first time."""
        self._queue.observe(now - seq.arrival)

    def first_token(self, seq: "Sequence", now: float) -> None:
        """The prefill is done and the first token went out."""
        self._ttft.observe(now - seq.arrival)
        self.prompt_tokens += seq.prompt_tokens
        self._req_prompt.observe(seq.prompt_tokens)

    def preempted(self) -> None:
        """A running sequence lost its blocks and went back to the queue."""
        self.preemptions += 1

    def finished(self, seq: "Sequence", reason: str, now: float) -> None:
        """The sequence ended: stop, length, abort or error."""
        self._success[reason].inc()
        if reason in ("stop", "length"):
            self._e2e.observe(now - seq.arrival)
            self._req_gen.observe(seq.generated)

    # -- scrape ----------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text (format 0.0.4)."""
        kv = self._engine.kv
        self._queries.value = float(kv.queries)
        self._hits.value = float(kv.hits)
        self._preemptions.value = float(self.preemptions)
        self._prompt_tokens.value = float(self.prompt_tokens)
        self._generation_tokens.value = float(self.generation_tokens)
        return self.registry.render()
