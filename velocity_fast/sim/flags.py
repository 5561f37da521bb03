"""Command-line flags of the sim engine (``velocityllm sim-engine``, ``python -m velocity_fast.sim``).

Imports nothing heavy so that ``velocityllm --help`` stays fast. Flag names follow
vLLM's where vLLM has the same knob, so a fake ``vllm serve`` can pass its flags through.
"""

from __future__ import annotations

import argparse

from .settings import SimConfig

_D = SimConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sim engine's flags to ``parser``."""
    p = parser
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model name (as `vllm serve MODEL`); same as --model",
    )
    p.add_argument("--model", default=None, help=f"served model name (default {_D.model})")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        type=str,
        help="vLLM's name for the served model; wins over --model (first name used)",
    )
    p.add_argument("--host", default=_D.host, help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=_D.port, help="port (default %(default)s; 0 picks a free one and prints it)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=_D.max_num_seqs, help="most sequences running at once (default %(default)s)"
    )
    p.add_argument(
        "--decode-tps",
        type=float,
        default=_D.decode_tps,
        help="tokens/s of one sequence at batch 1 (default %(default)s)",
    )
    p.add_argument(
        "--batch-contention",
        type=float,
        default=_D.batch_contention,
        help="step time = (1/decode_tps)*(1+contention*(batch-1)) (default %(default)s)",
    )
    p.add_argument(
        "--prefill-tps",
        type=float,
        default=_D.prefill_tps,
        help="prompt tokens/s computed in prefill (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_D.max_num_batched_tokens,
        help="tokens computed per step at most, chunked prefill (default %(default)s)",
    )
    p.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=int,
        default=None,
        help=f"KV-cache blocks (default {_D.num_gpu_blocks}, or enough for one sequence of --max-model-len)",
    )
    p.add_argument("--block-size", type=int, default=_D.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=None,
        help="freed blocks that keep their prefix content, LRU (default: all free blocks)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="automatic prefix caching (default on, as vLLM v1)",
    )
    p.add_argument(
        "--natural-stop",
        action="store_true",
        default=False,
        help="a reply may end by itself before max_tokens, as a model's do (without it every reply is "
        "exactly max_tokens long)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        default=False,
        help="usage reports prompt_tokens_details.cached_tokens when the prefix cache hit (as vLLM)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=_D.max_model_len,
        help="longest prompt + completion in tokens (default %(default)s)",
    )
    p.add_argument(
        "--natural-output-mean",
        type=int,
        default=_D.natural_output_mean,
        help="mean reply length when a request sets no max_tokens (default %(default)s)",
    )
    p.add_argument(
        "--fail-rate",
        type=float,
        default=_D.fail_rate,
        help="fraction of requests that fail, some before the response, some mid-stream (default %(default)s)",
    )
    p.add_argument(
        "--oom-rate",
        type=float,
        default=_D.oom_rate,
        help="fraction of requests that fail with `CUDA out of memory` (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=_D.seed, help="seed of generated text and failures (default %(default)s)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=_D.time_scale,
        help="run this many times faster than real time (default %(default)s)",
    )
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ paths")
    p.add_argument(
        "--startup-delay",
        type=float,
        default=_D.startup_delay,
        help="seconds before the port opens, like model loading (default %(default)s)",
    )
    p.add_argument(
        "--sse-keep-alive-interval",
        type=float,
        default=None,
        help="send `: keep-alive` comments on idle streams every this many seconds",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV events JSON, e.g. '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\","
        "\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\",\"topic\":\"kv\"}': "
        "publish BlockStored/BlockRemoved/AllBlocksCleared as vLLM does",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json: count, hash and publish prompts as its token ids "
        "(ChatML chat template; needs the `tokenizers` extra)",
    )
    p.add_argument(
        "--kv-transfer-ms-per-block",
        type=float,
        default=_D.kv_transfer_ms_per_block,
        help="disaggregation: milliseconds a decode engine's pull of one KV block takes (default %(default)s)",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=_D.kv_transfer_timeout,
        help="disaggregation: seconds a prefill engine holds blocks nobody pulls, vLLM's "
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT (default %(default)s)",
    )
    p.add_argument(
        "--write-tokenizer",
        default=None,
        metavar="FOLDER",
        help="write the sim's own tokenizer.json (a word each, for precise prefix routing "
        "without a download) into FOLDER, print its path and exit",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=_D.scheduling_policy,
        help="fcfs: first come, first served; priority: by the request's `priority` (lower "
        "first), and a full cache preempts the lowest priority's latest (default %(default)s)",
    )
    # vLLM launcher flags that a fake `vllm serve` passes through: accepted, no effect.
    ignored = p.add_argument_group("accepted for vLLM compatibility, ignored")
    ignored.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, help=argparse.SUPPRESS)
    ignored.add_argument("-dp", "--data-parallel-size", type=int, default=None, help=argparse.SUPPRESS)
    ignored.add_argument("--gpu-memory-utilization", type=float, default=None, help=argparse.SUPPRESS)
    ignored.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    ignored.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)
    ignored.add_argument("--disable-log-stats", action="store_true", help=argparse.SUPPRESS)
    ignored.add_argument("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)
    ignored.add_argument("--enforce-eager", action="store_true", help=argparse.SUPPRESS)
    ignored.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None, help=argparse.SUPPRESS)
    ignored.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None, help=argparse.SUPPRESS
    )
    for name in (
        "--kv-cache-dtype",
        "--quantization",
        "--revision",
        "--download-dir",
        "--load-format",
        "--distributed-executor-backend",
        "--uvicorn-log-level",
        "--swap-space",
        "--max-logprobs",
        "--generation-config",
    ):
        ignored.add_argument(name, default=None, help=argparse.SUPPRESS)
    for name in ("--enable-request-id-headers", "--disable-fastapi-docs", "--disable-uvicorn-access-log"):
        ignored.add_argument(name, action="store_true", help=argparse.SUPPRESS)
