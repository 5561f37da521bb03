"""Settings of one sim engine, with the defaults and why they were chosen.

Kept free of heavy imports: ``flags.py`` reads the defaults from here when the CLI
builds its parser.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class SimConfig:
    """Everything the sim engine's behaviour depends on."""

    model: str = "sim-model"
    #: What ``/v1/models`` shows as ``root`` (vLLM: the model path); defaults to ``model``.
    root: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    #: vLLM's default batch limit for online serving.
    max_num_seqs: int = 256
    #: Per-sequence decode speed at batch 1: a 7-8B model on one data-centre GPU.
    decode_tps: float = 50.0
    #: Step time = (1/decode_tps) * (1 + contention * (batch - 1)); 0.005 makes a full
    #: batch of 256 about 2.3x slower per step, as memory-bound decoding behaves.
    batch_contention: float = 0.005
    #: Prefill speed in tokens/s: a few thousand, so a 2k-token prompt costs ~0.4 s.
    prefill_tps: float = 5000.0
    #: Tokens computed per step at most (vLLM's chunked prefill budget).
    max_num_batched_tokens: int = 2048
    #: 2048 blocks * 16 tokens = 32k tokens of KV: a modest GPU, so KV pressure shows.
    num_gpu_blocks: int = 2048
    block_size: int = 16
    #: Freed blocks that keep their prefix content (LRU); None = all free blocks (vLLM).
    prefix_cache_blocks: int | None = None
    enable_prefix_caching: bool = True
    #: vLLM's ``--enable-prompt-tokens-details`` (off by default, as there): usage then
    #: carries ``prompt_tokens_details.cached_tokens`` when the prefix cache served any.
    enable_prompt_tokens_details: bool = False
    max_model_len: int = 4096
    #: Mean length of a reply that ends by itself (no max_tokens given).
    natural_output_mean: int = 128
    #: A reply may end by itself before max_tokens too (as a model's end-of-sequence
    #: does); off: a request with max_tokens gets exactly that many (the default).
    natural_stop: bool = False
    fail_rate: float = 0.0
    oom_rate: float = 0.0
    seed: int = 0
    #: Every duration (steps, prefill, startup delay, keep-alive) is divided by this.
    time_scale: float = 1.0
    api_key: str | None = None
    startup_delay: float = 0.0
    sse_keep_alive_interval: float | None = None
    #: vLLM's ``--kv-events-config`` JSON; events are published when it enables them.
    kv_events_config: str | None = None
    #: A ``tokenizer.json``: prompts are counted, hashed and published as its token ids.
    tokenizer: str | None = None
    #: Disaggregation (sim/pd.py): the time a decode engine's pull takes per KV block. A
    #: 16-token block of an 8B model is about 2 MB, which RDMA at ~20 GB/s moves in 0.1 ms.
    kv_transfer_ms_per_block: float = 0.1
    #: How long a prefill engine holds blocks no decode engine pulled (vLLM's
    #: VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    kv_transfer_timeout: float = 480.0
    #: vLLM's ``--scheduling-policy``: ``fcfs`` (its default) or ``priority``: waiting
    #: requests by their body's ``priority`` (lower first), then arrival, and a cache out
    #: of blocks preempts the running request of the lowest priority (highest value),
    #: latest arrival, not the newest.
    scheduling_policy: str = "fcfs"

    def validate(self) -> None:
        """Refuse settings vLLM would refuse, with a message naming the flag."""
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.decode_tps <= 0 or self.prefill_tps <= 0:
            raise ValueError("--decode-tps and --prefill-tps must be > 0")
        if self.batch_contention < 0:
            raise ValueError("--batch-contention must be >= 0")
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if self.block_size < 1 or self.num_gpu_blocks < 1:
            raise ValueError("--block-size and --num-gpu-blocks must be >= 1")
        if self.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        # vLLM refuses to start when one sequence of max_model_len would not fit.
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"--max-model-len {self.max_model_len} needs {-(-self.max_model_len // self.block_size)} "
                f"KV blocks but --num-gpu-blocks is {self.num_gpu_blocks}"
            )
        if not (0.0 <= self.fail_rate <= 1.0 and 0.0 <= self.oom_rate <= 1.0 and self.fail_rate + self.oom_rate <= 1.0):
            raise ValueError("--fail-rate and --oom-rate must be in [0, 1] and sum to at most 1")
        if self.kv_transfer_ms_per_block < 0 or self.kv_transfer_timeout <= 0:
            raise ValueError("--kv-transfer-ms-per-block must be >= 0 and --kv-transfer-timeout > 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.kv_events_config:
            from .kvevents import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)

    @classmethod
    def from_args(cls, args: object) -> "SimConfig":
        """Build from an argparse namespace (attributes named as the fields)."""
        kw = {}
        for f in fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                kw[f.name] = v
        served = getattr(args, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        positional = getattr(args, "model_tag", None)
        model = getattr(args, "model", None) or positional
        if served:
            kw["model"] = served
            kw["root"] = model or served
        elif model:
            kw["model"] = model
        cfg = cls(**kw)
        if "num_gpu_blocks" not in kw:  # room for one whole sequence, as vLLM needs to start
            cfg.num_gpu_blocks = max(cfg.num_gpu_blocks, -(-cfg.max_model_len // cfg.block_size))
        return cfg
