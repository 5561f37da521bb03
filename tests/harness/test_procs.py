"""harness.procs.stop: SIGTERM, SIGKILL after the grace, a paused child woken to act on
SIGTERM, and with ``sweep`` nothing of the child's process group left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.fakes import pid_alive, wait_until
from velocity_fast.harness.procs import start, stop

pytestmark = pytest.mark.timeout(60)


def child(code: str) -> subprocess.Popen:
    """``python -c code`` in its own process group; returns once it printed its first line."""
    p = start([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout.readline()
    return p


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    p = child(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    t0 = time.monotonic()
    code = stop(p, 0.5)
    assert code == -signal.SIGKILL and time.monotonic() - t0 >= 0.5


def test_a_child_that_acts_on_sigterm_exits_by_it():
    p = child(
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); "
        "print('up', flush=True); time.sleep(60)"
    )
    assert stop(p, 10.0) == 3


def test_a_paused_child_is_woken_to_act_on_sigterm():
    """A SIGSTOPped child (a paused redis-server) cannot run its SIGTERM handler: stop
    sends SIGCONT too, so it exits by its handler, not by the SIGKILL after the grace."""
    p = child(
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); "
        "print('up', flush=True); time.sleep(60)"
    )
    os.kill(p.pid, signal.SIGSTOP)
    assert stop(p, 10.0) == 3


GRANDCHILD = (
    "import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print(g.pid, flush=True); import time; time.sleep(60)"
)


@pytest.mark.parametrize("sweep", [False, True])
def test_sweep_kills_what_the_child_left_in_its_group(sweep):
    """The child exits on SIGTERM (sent to it alone) and leaves its own child running;
    only ``sweep`` reaches that one, through the process group."""
    p = start([sys.executable, "-c", GRANDCHILD], stdout=subprocess.PIPE)
    grandchild = int(p.stdout.readline())
    try:
        assert stop(p, 10.0, sweep=sweep) == -signal.SIGTERM
        if sweep:
            assert wait_until(lambda: not pid_alive(grandchild), 5.0)
        else:
            time.sleep(0.3)
            assert pid_alive(grandchild)
    finally:
        if pid_alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
