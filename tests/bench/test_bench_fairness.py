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

pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_fairness_bench_runs_every_variant(tmp_path):
    out = tmp_path / "fairness.json"
    proc = subprocess.run([sys.executable, "-m", "bench.fairness", "--smoke", "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=220)
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
