"""Flags for the engines that ``detect`` and ``chargeVelocity`` plan and start.

Imports nothing heavy, so that ``--help`` and the other commands stay fast.
"""

from __future__ import annotations

import argparse

DEFAULT_SIM_ENGINES = 2
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # vLLM's own default
DEFAULT_MAX_MODEL_LEN = 131072
DEFAULT_ENGINE_BASE_PORT = 8100  # above the gateway's 8000 and clear of the admin 9090


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (model, mock, counts, vLLM sizing, ports, logs) to ``parser``."""
    g = parser.add_argument_group("engines")
    g.add_argument(
        "--model-path",
        default=None,
        help="model folder holding config.json (else VELOCITY_MODEL_PATH, ./models, "
        "~/velocity-models, a prompt on a terminal)",
    )
    g.add_argument(
        "--mock",
        action="store_true",
        default=False,
        help="start built-in sim engines even when GPUs are present",
    )
    g.add_argument(
        "--engine",
        choices=("auto", "vllm", "sim"),
        default=None,
        help="which engines to start: vllm (on the GPUs found, else vLLM's CPU build; refused "
        "when no vLLM is found), sim (built-in sim engines, as --mock) or auto (vLLM on GPUs "
        "with a model, else sim) (default auto)",
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="a python that imports vllm, to run vLLM engines with (else the config's "
        "vllm_python:, the 'vllm' on PATH, the checkout's .vllm-venv)",
    )
    g.add_argument(
        "--engines",
        type=_positive_int,
        default=None,
        help=f"number of engines where it is not one per GPU: sim engines without GPUs or with "
        f"--mock ({DEFAULT_SIM_ENGINES} unless given), vLLM CPU engines with --engine vllm and no "
        "GPU (1 unless given)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="GPUs per vLLM engine; one engine per group of this many GPUs (default 1)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help=f"passed to vllm serve (default {DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    g.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=DEFAULT_MAX_MODEL_LEN,
        help=f"passed to every engine (default {DEFAULT_MAX_MODEL_LEN})",
    )
    g.add_argument(
        "--engine-base-port",
        type=_port,
        default=DEFAULT_ENGINE_BASE_PORT,
        help=f"first engine port; engines take the first free ports from it (default {DEFAULT_ENGINE_BASE_PORT})",
    )
    g.add_argument(
        "--engine-log-dir",
        default=None,
        help="folder for each engine's output (default: <tmp>/velocityllm-<uid>/engines)",
    )
