"""Processes a benchmark starts: pinned to a core, niced, killed with it, stopped whole.

Every child runs in its own session (its own process group), so that stopping it stops
what it started too (nginx's workers, a gateway's workers); each dies with the
benchmark (PR_SET_PDEATHSIG) if the benchmark dies without cleaning up.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
from pathlib import Path

_nice = 0  # the measured processes' niceness (set_nice), so that other work on a shared machine yields


def set_nice(value: int) -> None:
    """The niceness every child started from now on gets (negative: root only)."""
    global _nice
    _nice = value


def child_setup(cpu: int | None):
    """preexec_fn: pin the child, set its niceness, and have it killed if this script dies
    without cleaning up."""
    nice = _nice

    def setup() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    return setup


class Procs:
    """Every process this run started, each in its own session so that it can be stopped whole."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], cpu: int | None, log: Path | None = None, **kw) -> subprocess.Popen:
        out = open(log, "wb") if log is not None else subprocess.PIPE
        try:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=child_setup(cpu),
                                 start_new_session=True, **kw)
        finally:
            if log is not None:
                out.close()
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 5.0) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(grace)
        if p.stdout is not None:
            p.stdout.close()
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
    deadline = time.monotonic() + timeout
    seen = []
    os.set_blocking(p.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        if p.poll() is not None:
            break
        chunk = p.stdout.read() or b""
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        if not chunk:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start: " + " | ".join(seen[-5:]))


def wait_ready(check, timeout: float, what: str, log: Path | None = None) -> None:
    """Until ``check()`` is true; a RuntimeError with the log's tail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-800:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s. {tail}")
