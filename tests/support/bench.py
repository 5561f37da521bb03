"""The benchmark scripts in bench/ as modules, for tests that call their functions, and
bench/upstream_fixed.py as a process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from velocity_fast.harness.procs import start, stop

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py (the module bench.<name>), loaded afresh (a test may patch its functions)."""
    spec = importlib.util.spec_from_file_location(f"bench.{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def fixed_upstream(*extra: str) -> Iterator[int]:
    """bench/upstream_fixed.py (the "infinitely fast engine") on a free port of 127.0.0.1
    for a ``with`` block: its port. Stopped at the end, even on failure."""
    proc = start(
        [sys.executable, "-m", "bench.upstream_fixed", "--port", "0", *extra],
        cwd=BENCH.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        proc.stdout.close()
        if not line.startswith("listening on"):
            raise RuntimeError(f"fixed upstream did not start: {line!r}")
        yield int(line.rsplit(":", 1)[1])
    finally:
        stop(proc, 10.0, kill_grace=10.0)
