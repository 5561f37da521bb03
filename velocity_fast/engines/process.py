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
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from ..harness.procs import PACKAGE_ROOT, python_child, read_tail, signal_group, start

__all__ = ["PACKAGE_ROOT", "python_child", "read_tail", "signal_group", "spawn", "wait_exit"]


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
        proc = start(
            argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, close_fds=True, death_signal=death_signal
        )
    return proc, offset


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
