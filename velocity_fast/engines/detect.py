"""GPU detection: NVML first (``pynvml`` from nvidia-ml-py), ``nvidia-smi`` as fallback.

Both ways block (NVML initialises the driver, ``nvidia-smi`` is a subprocess), so the
event loop calls :func:`detect_gpus_async`, which runs the detection in a thread.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

NVIDIA_SMI_QUERY = (
    "--query-gpu=index,name,memory.total",
    "--format=csv,noheader,nounits",
)
# nvidia-smi can hang for many seconds on a wedged driver; detection must end.
NVIDIA_SMI_TIMEOUT_S = 15.0
_MIB = 1024 * 1024


@dataclass(frozen=True)
class GPU:
    """One GPU as the launcher needs it: its physical index, name and memory."""

    index: int
    name: str
    memory_mib: int


@dataclass(frozen=True)
class Detection:
    """What detection found: the GPUs, the way they were found, and a note for humans."""

    gpus: tuple[GPU, ...]
    source: str  # "nvml", "nvidia-smi" or "none"
    notes: tuple[str, ...] = field(default=())

    @property
    def count(self) -> int:
        """The number of GPUs found."""
        return len(self.gpus)


def detect_gpus(environ: Mapping[str, str] | None = None) -> Detection:
    """Find the GPUs through NVML, else ``nvidia-smi``; neither gives no GPU.

    Blocking: call it from a thread (see :func:`detect_gpus_async`) when a loop runs.
    ``CUDA_VISIBLE_DEVICES`` in ``environ`` narrows the result to the GPUs it names.
    """
    env = os.environ if environ is None else environ
    notes: list[str] = []
    gpus = _from_nvml(notes)
    source = "nvml"
    if gpus is None:
        gpus = _from_nvidia_smi(notes, env)
        source = "nvidia-smi"
    if gpus is None:
        return Detection((), "none", tuple(notes))
    return Detection(tuple(_visible(gpus, env, notes)), source, tuple(notes))


async def detect_gpus_async(environ: Mapping[str, str] | None = None) -> Detection:
    """:func:`detect_gpus` in a worker thread, so the event loop never waits on the driver."""
    return await asyncio.to_thread(detect_gpus, environ)


def _from_nvml(notes: list[str]) -> list[GPU] | None:
    try:
        # Imported here: the module only exists with the ``gpu`` extra.
        import pynvml
    except ImportError:
        notes.append("NVML: pynvml is not installed (pip install 'velocityllm[gpu]')")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError has many subclasses; any means "no NVML here"
        notes.append(f"NVML: cannot initialise ({exc})")
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):  # nvidia-ml-py before 11.515 returned bytes
                name = name.decode("utf-8", "replace")
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(GPU(i, str(name), int(total) // _MIB))
        return gpus
    except Exception as exc:
        notes.append(f"NVML: query failed ({exc})")
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting down a half-initialised NVML must not hide the result
            pass


def _from_nvidia_smi(notes: list[str], env: Mapping[str, str]) -> list[GPU] | None:
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        notes.append("nvidia-smi: not found on PATH")
        return None
    try:
        proc = subprocess.run(
            [exe, *NVIDIA_SMI_QUERY],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            env=dict(env),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        notes.append(f"nvidia-smi: {exc}")
        return None
    if proc.returncode != 0:
        # "No devices were found" exits non-zero: that is no GPU, not an error to raise.
        message = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
        notes.append(f"nvidia-smi: exit {proc.returncode}: {message[0] if message else ''}")
        return None
    try:
        return parse_nvidia_smi(proc.stdout)
    except ValueError as exc:
        notes.append(f"nvidia-smi: unreadable output ({exc})")
        return None


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Parse ``index, name, memory.total`` CSV lines (noheader, nounits) into GPUs."""
    gpus = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3:
            raise ValueError(f"expected 'index, name, memory' in {line!r}")
        # The name sits between the first and last field, in case it holds a comma.
        gpus.append(GPU(int(fields[0]), ", ".join(fields[1:-1]), int(float(fields[-1]))))
    return gpus


def _visible(gpus: list[GPU], env: Mapping[str, str], notes: list[str]) -> list[GPU]:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return gpus
    wanted = [p.strip() for p in cvd.split(",") if p.strip()]
    if not all(p.isdigit() for p in wanted):
        # UUID or MIG forms cannot be matched against indices; trust the full list.
        notes.append(f"CUDA_VISIBLE_DEVICES={cvd!r} is not a list of indices; ignored")
        return gpus
    by_index = {g.index: g for g in gpus}
    kept = [by_index[int(p)] for p in wanted if int(p) in by_index]
    notes.append(f"CUDA_VISIBLE_DEVICES={cvd!r}: using {len(kept)} of {len(gpus)} GPUs")
    return kept
