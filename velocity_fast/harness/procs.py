"""Child processes: start one in a process group of its own, tied to this process's life,
and stop it (SIGTERM, then SIGKILL after a grace).

A child started here leads a new process group, so that stopping it reaches whatever it
forked (a gateway's workers and engines, vLLM's engine-core). On Linux it may also ask the
kernel (``prctl(PR_SET_PDEATHSIG)``) for a signal when its parent dies, so that it does not
outlive a parent killed with SIGKILL or a timeout; the kernel sends it when the *thread*
that forked exits, so a child started from a short-lived thread (a test's pool) asks for none.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

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
    return ([sys.executable, "-P", "-m", module], {"PYTHONPATH": PACKAGE_ROOT + (os.pathsep + path if path else "")})


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without its ``VELOCITY_*`` variables (a child gateway is set by its
    flags and files alone), this package first on PYTHONPATH, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOCITY_")}
    env.update(python_child("velocity_fast")[1])
    env.update(extra or {})
    return env


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once in the parent: the child between fork and exec must not load libraries.
_PRCTL = _libc_prctl()


def death_signal_hook(sig: int, then: Callable[[], None] | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when this thread dies,
    then runs ``then`` (pinning, niceness); None where there is no prctl and nothing to run."""
    if _PRCTL is None:
        return then
    parent = os.getpid()
    prctl = _PRCTL

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        # The parent may have died between fork and prctl: then no signal would ever come.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
        if then is not None:
            then()

    return hook


def start(
    argv: Sequence[str],
    *,
    log: str | os.PathLike | None = None,
    append: bool = True,
    death_signal: int | None = None,
    setup: Callable[[], None] | None = None,
    **popen,
) -> subprocess.Popen:
    """``argv`` as a child leading its own process group, stdin closed.

    ``log``: stdout and stderr go to this file (appended, unless ``append`` is false);
    otherwise ``popen`` says where (``stdout=``, ``stderr=``), as it may pass ``env``,
    ``cwd`` and ``text``. ``death_signal``: what the child gets when the thread that
    forks it exits (SIGTERM lets a gateway or vLLM stop its own children; None: nothing).
    ``setup`` runs in the child before exec.
    """
    hook = death_signal_hook(death_signal, setup) if death_signal else setup
    popen.setdefault("stdin", subprocess.DEVNULL)
    if log is None:
        return subprocess.Popen(list(argv), process_group=0, preexec_fn=hook, **popen)
    with open(log, "ab" if append else "wb") as out:
        return subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, process_group=0, preexec_fn=hook, **popen
        )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the child's whole process group (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _leads_group(proc: subprocess.Popen) -> bool:
    # Asked while the child is not reaped yet, so that its pid is still its own.
    if proc.returncode is not None:
        return False
    try:
        return os.getpgid(proc.pid) == proc.pid
    except (ProcessLookupError, PermissionError):
        return False


def _send(proc: subprocess.Popen, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def stop_all(
    procs: Iterable[subprocess.Popen | None],
    grace: float = 10.0,
    *,
    whole: bool = False,
    sweep: bool = False,
    kill_grace: float = 5.0,
    group: bool | None = None,
) -> None:
    """Stop every child at once: SIGTERM to each (in the order given), SIGKILL to what still
    runs ``grace`` seconds later, each reaped and its pipes closed.

    The SIGTERM goes to the child alone, which stops what it started itself (a gateway its
    workers and engines), or with ``whole`` to its whole process group. A SIGCONT follows
    it: a stopped child cannot act on SIGTERM. The SIGKILL reaches the child's whole group
    when the child leads one (``group``: whether it does; None: find out, which needs a
    child not reaped yet). ``sweep``: SIGKILL to the group after the child exited too, so
    that nothing it left behind lives on.
    """
    todo = []
    for p in procs:
        if p is None:
            continue
        leads = _leads_group(p) if group is None else group
        live = p.poll() is None
        if live:
            _send(p, signal.SIGTERM, whole and leads)
            _send(p, signal.SIGCONT, whole and leads)
        todo.append((p, leads, live))
    deadline = time.monotonic() + grace
    for p, leads, live in todo:
        if live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _send(p, signal.SIGKILL, leads)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(kill_grace)
        if sweep and leads:
            _send(p, signal.SIGKILL, True)
        for pipe in (p.stdin, p.stdout, p.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def stop(
    proc: subprocess.Popen | None,
    grace: float = 10.0,
    *,
    whole: bool = False,
    sweep: bool = False,
    kill_grace: float = 5.0,
    group: bool | None = None,
) -> int | None:
    """Stop one child as :func:`stop_all` does; its exit code (None: never started, or
    not reaped even after SIGKILL)."""
    stop_all([proc], grace, whole=whole, sweep=sweep, kill_grace=kill_grace, group=group)
    return None if proc is None else proc.returncode


def read_tail(path: str | os.PathLike, offset: int = 0, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines written to ``path`` after ``offset`` (blocking, small)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start_at = max(offset, size - max_bytes)
            f.seek(start_at)
            data = f.read()
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    text = data.decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])
