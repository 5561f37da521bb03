"""bench/fairness.py at smoke size: every variant runs on the seeded traffic, every
tenant is served, and each figure of the table is a number (never the values: CI's
machine is noisy)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.timed]  # a throughput ratio

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_fairness_bench_runs_every_variant(tmp_path):
    out = tmp_path / "fairness.json"
    # The smoke's 4 s a variant: over 1.5 s vtc-estimate serves the tenant whose estimates
    # stand at 10x its service nothing at all (they are its counter's, and a lift no longer
    # copies the others' estimates in flight to even them out), and every tenant served is
    # part of what this test asks.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fairness", "--smoke", "--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "vtc-actual within its bound" in proc.stdout and "locality: hit rate" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["variant"] for r in runs] == ["rr", "vtc-estimate", "vtc-actual", "locality"]
    for r in runs:
        assert r["completed"] > 0 and r["failed"] == 0, r
        assert all(r["share"][t] > 0 for t in ("prompts", "answers", "mixed")), r
        for key in ("max_gap", "vtc_bound", "hit_rate", "tokens_per_s", "requests_per_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
    assert runs[3]["locality_bound"] > 0


@pytest.mark.timeout(120)
def test_fairness_bench_cache_bound_locality_beats_vtc(tmp_path):
    """The cache-bound scenario at smoke size (about 20 s): rr, vtc-actual and locality
    run, the ratios line and the goal in words are printed, and locality hits at least
    1.5x vtc-actual's prefix-cache hit rate with more throughput. Asserted because short
    runs give it with room: 2.0-2.5x the hit rate and 2.0-2.3x the throughput at smoke
    size over three seeds (1.8x and 2.0x over 20 s); the hit rate is a count of tokens,
    not of time, so a slow machine moves it little. The gaps and the bounds are checked
    as numbers only: over 4 s they swing by thousands of tokens."""
    out = tmp_path / "cache-bound.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fairness", "--scenario", "cache-bound", "--smoke", "--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "locality: hit rate" in proc.stdout and "goal (at least 1.5x the hit rate" in proc.stdout
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [r["variant"] for r in runs] == ["rr", "vtc-actual", "locality"]
    for r in runs:
        assert r["completed"] > 0 and r["failed"] == 0, r
        assert len(r["share"]) == 16 and all(v > 0 for v in r["share"].values()), r
        for key in ("max_gap", "max_gap_dispatch", "vtc_bound", "counter_bound", "hit_rate", "tokens_per_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
    ratios = data["locality_vs_vtc"]
    assert ratios["hit_rate"] >= 1.5, ratios
    assert ratios["throughput"] > 1.0, ratios


@pytest.mark.timeout(120)
def test_fairness_bench_weights_are_kept_from_charge_to_lift(tmp_path):
    """The weights scenario (about 15 s): tenants of weights 1 and 3 whose requests differ
    10x, at the gateway's defaults. Over the run, their services from the engines' usage
    (/stats' tokens) divided by their weights are within 1.5x of each other, and each
    tenant's counter is within one request's cost of that weighted service (/stats shows
    both). Before the lift left out estimates in flight the light tenant was lifted once
    to the heavy one's estimates at the start and kept them: 37,940 above its service,
    2.98x below its share over the run (1.21-1.23x after, counters 0 apart)."""
    out = tmp_path / "weights.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.fairness",
            "--scenario",
            "weights",
            "--variants",
            "vtc-actual",
            "--duration",
            "6",
            "--warmup",
            "1.5",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "goal (vtc-actual: weighted services within 1.5x" in proc.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["completed"] > 0 and run["failed"] == 0, run
    books = run["books"]
    assert set(books) == {"heavy", "light"} and all(b["served"] > 0 for b in books.values()), books
    for name, b in books.items():
        assert abs(b["counter"] - b["weighted_served"]) <= run["largest_cost"], (name, b, run["largest_cost"])
    assert run["books_ratio"] <= 1.5, (run["books_ratio"], books)
