"""bench/overhead.py's measured runs on a machine that pauses: a run that took far longer
than asked (every process stopped for seconds, each request in flight timed out) measures
the pause, not the proxy, so it is run once more and the pause recorded; a run of normal
length is never repeated, and a second paused run stands with its errors, so that a proxy
that itself hangs still fails the smoke test."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.support.bench import bench_module

pytestmark = pytest.mark.timeout(30)


def _overhead():
    return bench_module("overhead")


def _runs(mod, monkeypatch, seconds: list[float]) -> tuple[dict, list[float]]:
    left = list(seconds)
    done: list[float] = []

    def once(target, args, work, load_pids, body):
        s = left.pop(0)
        done.append(s)
        return {"seconds": s, "requests": 100, "errors": 64 if s > 10 else 0, "non2xx": 0}

    monkeypatch.setattr(mod, "_throughput_once", once)
    args = argparse.Namespace(client="wrk", duration=1.0)
    out = mod.throughput(mod.Target("direct", 1, None), args, Path("."), [])
    return out, done


@pytest.mark.parametrize(
    "seconds, runs, stalled, errors",
    [
        ([1.01], 1, None, 0),  # a normal run: kept
        ([5.9], 1, None, 0),  # slow, not a pause (under 1 s + 5 s): kept
        ([20.2, 1.02], 2, 20.2, 0),  # paused: run again, the pause recorded
        ([20.2, 19.0], 2, 20.2, 64),  # paused twice: the second run stands, errors and all
    ],
)
def test_a_run_the_machine_paused_is_run_once_more(monkeypatch, capsys, seconds, runs, stalled, errors):
    mod = _overhead()
    out, done = _runs(mod, monkeypatch, seconds)
    assert len(done) == runs
    assert out.get("stalled_s") == stalled
    assert out["errors"] == errors
    if stalled:
        assert "took 20.2 s (the machine paused)" in capsys.readouterr().err
