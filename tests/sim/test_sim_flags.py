"""Flags of the sim engine: vLLM's names and aliases, defaults, validation."""

from __future__ import annotations

import argparse

import pytest

from velocity_fast.sim.flags import add_arguments
from velocity_fast.sim.settings import SimConfig


def parse(*argv: str) -> SimConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return SimConfig.from_args(p.parse_args(list(argv)))


def test_defaults_are_valid_and_vllm_like():
    cfg = parse()
    cfg.validate()
    assert cfg.block_size == 16 and cfg.enable_prefix_caching and cfg.host == "127.0.0.1"
    assert cfg.max_model_len == 4096 and cfg.max_num_seqs == 256
    assert cfg.time_scale == 1.0 and cfg.fail_rate == 0.0


def test_model_name_forms():
    assert parse("--model", "m").model == "m"
    assert parse("org/llama").model == "org/llama"  # as `vllm serve MODEL`
    cfg = parse("org/llama", "--served-model-name", "llama")
    assert cfg.model == "llama" and cfg.root == "org/llama"
    cfg = parse("--model", "org/x", "--served-model-name", "a", "b")
    assert cfg.model == "a" and cfg.root == "org/x"


def test_vllm_launcher_flags_are_accepted_and_ignored():
    cfg = parse(
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--tensor-parallel-size",
        "2",
        "--gpu-memory-utilization",
        "0.92",
        "-dp",
        "1",
        "--kv-events-config",
        "{}",
        "--max-num-seqs",
        "8",
        "--enable-prefix-caching",
    )
    assert cfg.port == 9001 and cfg.max_num_seqs == 8 and cfg.enable_prefix_caching


def test_sim_flags():
    cfg = parse(
        "--decode-tps",
        "30",
        "--batch-contention",
        "0.01",
        "--prefill-tps",
        "2000",
        "--num-gpu-blocks",
        "64",
        "--block-size",
        "32",
        "--prefix-cache-blocks",
        "8",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "1024",
        "--fail-rate",
        "0.1",
        "--oom-rate",
        "0.05",
        "--seed",
        "3",
        "--time-scale",
        "10",
        "--api-key",
        "k",
        "--startup-delay",
        "2",
        "--sse-keep-alive-interval",
        "5",
    )
    cfg.validate()
    assert (cfg.decode_tps, cfg.batch_contention, cfg.prefill_tps) == (30, 0.01, 2000)
    assert (cfg.num_gpu_blocks, cfg.block_size, cfg.prefix_cache_blocks) == (64, 32, 8)
    assert not cfg.enable_prefix_caching and cfg.max_model_len == 1024
    assert (cfg.fail_rate, cfg.oom_rate, cfg.seed, cfg.time_scale) == (0.1, 0.05, 3, 10)
    assert (cfg.api_key, cfg.startup_delay, cfg.sse_keep_alive_interval) == ("k", 2, 5)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--num-gpu-blocks", "10"), "--num-gpu-blocks"),  # 160 tokens < max_model_len 4096
        (("--time-scale", "0"), "--time-scale"),
        (("--fail-rate", "0.8", "--oom-rate", "0.5"), "--fail-rate"),
        (("--max-num-seqs", "0"), "--max-num-seqs"),
    ],
)
def test_invalid_settings_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse(*argv).validate()
