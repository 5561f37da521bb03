"""Engine child processes: each in its own process group, tied to the gateway's life.

Every child leads a new process group, so that stopping it reaches whatever it forked
(vLLM starts engine-core and worker processes). On Linux each child also asks the kernel
(``prctl(PR_SET_PDEATHSIG)``) for a signal when its parent dies, so that no engine outlives
a gateway killed with SIGKILL. The signal is SIGTERM by default, not SIGKILL: vLLM shuts
its own children down on SIGTERM, whereas a killed ``vllm serve`` would orphan them.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1

#: The folder that holds the ``velocity_fast`` this process runs (installed or a source tree).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def python_child(module: str) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that run ``python -m module`` on the very code this process runs.

    ``python -m`` puts the working folder first on the path, so a child started from a
    source checkout would import the uncompiled tree instead of the installed package
    (or another checkout's). ``-P`` (Python 3.11+) leaves the working folder out, and
    PYTHONPATH names this package's own folder first.
    """
    path = os.environ.get("PYTHONPATH")
    return ([sys.executable, "-P", "-m", module],
            {"PYTHONPATH": PACKAGE_ROOT + (os.pathsep + path if path else "")})


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once in the parent: the child between fork and exec must not load libraries.
_PRCTL = _libc_prctl()


def _death_signal_hook(sig: int) -> Callable[[], None] | None:
    if _PRCTL is None:
        return None
    parent = os.getpid()
    prctl = _PRCTL

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        # The parent may have died between fork and prctl: then no signal would ever come.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return hook


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    death_signal: int | None = signal.SIGTERM,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``argv`` with ``env`` over this environment, output appended to ``log_path``.

    Returns the process and the log offset where its output begins. Must run on the thread
    that owns the children (the event loop's): the kernel sends the death signal when the
    *thread* that forked exits, so forking from a short-lived worker thread would kill
    the engine with it. Forking takes milliseconds, once per engine start.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env)
    # Engines are Python programs; unbuffered output makes the log tail current on failure.
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    log: IO[bytes]
    with open(log_path, "ab") as log:
        offset = log.tell()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== {stamp} starting: {' '.join(argv)}\n".encode())
        log.flush()
        hook = _death_signal_hook(death_signal) if death_signal else None
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            close_fds=True,
            process_group=0,
            preexec_fn=hook,
        )
    return proc, offset


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the child's whole process group (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def wait_exit(proc: subprocess.Popen[bytes], poll_interval: float = 0.1) -> int:
    """Wait without blocking the loop until ``proc`` exits; return its exit code.

    Uses a pidfd (Linux 5.3+) that becomes readable at exit, else polls.
    """
    if proc.returncode is not None:
        return proc.returncode
    loop = asyncio.get_running_loop()
    pidfd = -1
    if hasattr(os, "pidfd_open"):
        with contextlib.suppress(OSError):
            pidfd = os.pidfd_open(proc.pid)
    if pidfd >= 0:
        done = loop.create_future()
        loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
    # A readable pidfd means the child has exited; reaping it is then immediate.
    while proc.poll() is None:
        await asyncio.sleep(poll_interval if pidfd < 0 else 0.005)
    return proc.returncode  # type: ignore[return-value]


def read_tail(path: Path, offset: int = 0, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines written to ``path`` after ``offset`` (blocking, small)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(offset, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    text = data.decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])
