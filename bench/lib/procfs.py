"""Figures read from /proc: CPU ticks of a process, run-queue wait of its threads, the
per-core busy time, a process's open files and resident memory, the CPU's model."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) of one process (all its threads), in clock ticks; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]), int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0, 0


def runq_wait_ns(pids: list[int]) -> int | None:
    """Nanoseconds the threads of these processes spent runnable but waiting for a CPU
    (/proc/PID/task/TID/schedstat); None where the kernel does not keep schedstats."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except FileNotFoundError:
                continue
            except (OSError, IndexError, ValueError):
                return None
    return total


def core_times() -> dict[int, tuple[int, int, int]]:
    """Per-CPU (busy, interrupt, total) clock ticks from /proc/stat. Interrupt time is
    mostly our own loopback traffic, which no process is charged for."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            m = re.match(r"cpu(\d+) (.*)", line)
            if m:
                v = [int(x) for x in m.group(2).split()]
                idle = v[3] + v[4]
                total = sum(v[:8])
                out[int(m.group(1))] = (total - idle, v[5] + v[6], total)
    return out


def fds(pid: int) -> int:
    """Open file descriptors of the process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    """Resident memory of the process, KiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"
