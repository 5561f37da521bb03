"""Processes a benchmark starts: pinned to a core, niced, killed with it, stopped whole.

Every child is started and stopped by the harness (velocity_fast/harness/procs.py): in
its own process group, so that stopping it stops what it started too (nginx's workers, a
gateway's workers), and it dies with the benchmark (PR_SET_PDEATHSIG) if the benchmark
dies without cleaning up.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from velocity_fast.harness.probe import read_line
from velocity_fast.harness.probe import wait_until as wait_ready  # noqa: F401  (the benchmarks' name)
from velocity_fast.harness.procs import death_signal_hook, start, stop

_nice = 0  # the measured processes' niceness (set_nice), so that other work on a shared machine yields


def set_nice(value: int) -> None:
    """The niceness every child started from now on gets (negative: root only)."""
    global _nice
    _nice = value


def _pin(cpu: int | None):
    nice = _nice

    def setup() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)

    return setup


def child_setup(cpu: int | None):
    """preexec_fn: pin the child, set its niceness, and have it killed if this script dies
    without cleaning up."""
    return death_signal_hook(signal.SIGTERM, _pin(cpu))


class Procs:
    """Every process this run started, each in its own process group so that it can be stopped whole."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], cpu: int | None, log: Path | None = None, **kw) -> subprocess.Popen:
        if log is None:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.STDOUT)
        p = start(argv, log=log, append=False, death_signal=signal.SIGTERM, setup=_pin(cpu), **kw)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 5.0) -> None:
        stop(p, grace, whole=True, kill_grace=grace)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p)


def group_pids(root: int) -> list[int]:
    """The process and its descendants (nginx's workers under its master)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def wait_line(p: subprocess.Popen, pattern: str, timeout: float, what: str) -> re.Match:
    """Read the child's output until a line matches (it must print it once ready)."""
    return read_line(p, re.compile(pattern.encode()), time.monotonic() + timeout, what, lambda: "")
