"""A fake GPU machine for tests: fake `nvidia-smi` and `vllm` first on PATH.

``fake_machine`` (a pytest fixture, registered for every test by tests/conftest.py) returns a function
``make(gpu_count, **env)`` that stands the fakes first on PATH with ``gpu_count`` GPUs,
hides any real NVML (``pynvml``), and returns a FakeMachine whose ``launches()`` reads what
each fake ``vllm serve`` was started with. ``machine_env`` builds the same environment as
a dict for a subprocess.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from velocity_fast.harness.ports import free_port_range

FAKES_DIR = Path(__file__).resolve().parent
REPO_ROOT = FAKES_DIR.parents[2]


@dataclass
class FakeMachine:
    """The fake machine's settings and what its fake `vllm` recorded."""

    gpu_count: int
    record_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    def launches(self) -> list[dict]:
        """Every `vllm serve` launch so far, oldest first."""
        out = []
        for path in glob.glob(str(self.record_dir / "launch-*.json")):
            with open(path) as f:
                out.append(json.load(f))
        return sorted(out, key=lambda d: d["time"])


def machine_env(
    gpu_count: int,
    record_dir: str | os.PathLike[str],
    base: Mapping[str, str] | None = None,
    **extra: str,
) -> dict[str, str]:
    """A full environment with the fakes first on PATH and ``gpu_count`` fake GPUs.

    ``extra`` adds variables such as FAKE_VLLM_SIM_ARGS or FAKE_VLLM_CRASH_AFTER (see the
    fake `vllm`'s docstring).
    """
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(FAKES_DIR), env.get("PATH", "")])
    env["FAKE_GPU_COUNT"] = str(gpu_count)
    env["FAKE_VLLM_RECORD_DIR"] = str(record_dir)
    env["FAKE_VLLM_PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("VELOCITY_MODEL_PATH", None)
    env.update(extra)
    return env


@pytest.fixture
def fake_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., FakeMachine]:
    """``make(gpu_count, **env)``: this process sees a machine with fake GPUs and vLLM."""

    def make(gpu_count: int, **extra: str) -> FakeMachine:
        record_dir = tmp_path / "vllm-launches"
        record_dir.mkdir(exist_ok=True)
        env = machine_env(gpu_count, record_dir, **extra)
        for key in ("CUDA_VISIBLE_DEVICES", "VELOCITY_MODEL_PATH"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            if os.environ.get(key) != value:
                monkeypatch.setenv(key, value)
        # None in sys.modules makes `import pynvml` fail: the nvidia-smi path is tested.
        monkeypatch.setitem(sys.modules, "pynvml", None)
        return FakeMachine(gpu_count, record_dir, env)

    return make


def make_model_folder(root: Path, name: str = "tiny-llama") -> Path:
    """A model folder that passes the launcher's check (config.json present)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return folder


# A base port of ``count`` free ports, below the kernel's ephemeral range (the loadgen's).
free_port_block = free_port_range


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``pred`` until true or ``timeout`` seconds passed; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
