"""GPU detection: the nvidia-smi path through the fake, the NVML path through a fake
pynvml module, the fallback between them, and the thread the async wrapper uses."""

from __future__ import annotations

import asyncio
import sys
import threading
import types

import pytest

from velocity_fast.engines.detect import (
    GPU,
    detect_gpus,
    detect_gpus_async,
    parse_nvidia_smi,
)


@pytest.mark.parametrize("count", [0, 1, 4])
def test_nvidia_smi_path_reports_every_gpu(fake_machine, count):
    fake_machine(count)
    found = detect_gpus()
    assert found.count == count
    assert [g.index for g in found.gpus] == list(range(count))
    assert all(g.name == "NVIDIA H100 80GB HBM3" and g.memory_mib == 81559 for g in found.gpus)
    if count:
        assert found.source == "nvidia-smi"
    else:
        assert found.source == "none"
        assert any("No devices were found" in n for n in found.notes)
    assert any("pynvml is not installed" in n for n in found.notes)


def test_no_nvml_and_no_nvidia_smi_means_no_gpu(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    found = detect_gpus()
    assert found.gpus == () and found.source == "none"
    assert any("nvidia-smi: not found" in n for n in found.notes)


def test_gpu_name_and_memory_come_from_nvidia_smi(fake_machine):
    fake_machine(2, FAKE_GPU_NAME="NVIDIA A10G", FAKE_GPU_MEMORY_MIB="23028")
    assert detect_gpus().gpus == (GPU(0, "NVIDIA A10G", 23028), GPU(1, "NVIDIA A10G", 23028))


def test_cuda_visible_devices_narrows_the_gpus(fake_machine, monkeypatch):
    fake_machine(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [g.index for g in detect_gpus().gpus] == [3, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_gpus().gpus == ()


class FakeNVML(types.ModuleType):
    """A pynvml stand-in: GPUs as (name, bytes total); records calls and threads."""

    def __init__(self, gpus, fail_init=False, bytes_names=False):
        super().__init__("pynvml")
        self.gpus = gpus
        self.fail_init = fail_init
        self.bytes_names = bytes_names
        self.calls: list[str] = []
        self.threads: set[int] = set()

    def nvmlInit(self):
        self.calls.append("init")
        self.threads.add(threading.get_ident())
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetName(self, handle):
        name = self.gpus[handle[1]][0]
        return name.encode() if self.bytes_names else name

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(total=self.gpus[handle[1]][1], free=0, used=0)


GIB = 1024**3


@pytest.mark.parametrize("bytes_names", [False, True])
def test_nvml_path_is_preferred_and_shut_down(fake_machine, monkeypatch, bytes_names):
    fake_machine(4)  # nvidia-smi would say 4; NVML must win
    nvml = FakeNVML([("NVIDIA L4", 24 * GIB), ("NVIDIA L4", 24 * GIB)], bytes_names=bytes_names)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    found = detect_gpus()
    assert found.source == "nvml"
    assert found.gpus == (GPU(0, "NVIDIA L4", 24576), GPU(1, "NVIDIA L4", 24576))
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_failure_falls_back_to_nvidia_smi(fake_machine, monkeypatch):
    fake_machine(1)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([], fail_init=True))
    found = detect_gpus()
    assert found.source == "nvidia-smi" and found.count == 1
    assert any("NVML: cannot initialise" in n for n in found.notes)


async def test_async_detection_runs_off_the_event_loop_thread(monkeypatch):
    nvml = FakeNVML([("NVIDIA H200", 141 * GIB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    found = await detect_gpus_async()
    assert found.count == 1 and found.gpus[0].name == "NVIDIA H200"
    assert nvml.threads and threading.get_ident() not in nvml.threads


async def test_async_nvidia_smi_detection_leaves_the_loop_responsive(fake_machine):
    fake_machine(4)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    t = asyncio.create_task(ticker())
    try:
        found = await detect_gpus_async()
    finally:
        t.cancel()
    assert found.count == 4
    # Starting a Python nvidia-smi takes tens of ms: the loop kept turning meanwhile.
    assert ticks >= 3


def test_parse_nvidia_smi_lines():
    text = "0, NVIDIA H100 80GB HBM3, 81559\n\n1, Weird, Name, 1024\n"
    assert parse_nvidia_smi(text) == [GPU(0, "NVIDIA H100 80GB HBM3", 81559), GPU(1, "Weird, Name", 1024)]
    with pytest.raises(ValueError):
        parse_nvidia_smi("garbage\n")
