"""bench/reliability.py --smoke runs every part and prints every figure as a number; the
figures that must hold (no 500 of the gateway's, no hang, nothing lost, counters that
reconcile) hold even at these counts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.support.sim import REPO


@pytest.mark.timeout(240)
def test_smoke_prints_a_number_for_every_figure(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.reliability", "--smoke", "--json", str(out)],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    for part in (
        "slowloris_p99_ratio",
        "slowloris_408s",
        "slowloris_fds_after",
        "heads_500s",
        "heads_hangs",
        "bodies_500s",
        "faults_counters_reconcile",
        "soak_rss_growth_pct",
        "soak_lost",
        "soak_capacity_per_s",
        "reload_failed_requests",
        "soak_counters_reconcile",
    ):
        assert part in figures, (part, sorted(figures))
    for name, v in figures.items():
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (name, v)
        assert f"  {name} " in proc.stdout  # printed, one line each
    assert figures["heads_500s"] == figures["bodies_500s"] == 0
    assert figures["heads_hangs"] == figures["bodies_hangs"] == 0
    assert figures["fuzz_internal_errors"] == figures["faults_internal_errors"] == 0
    assert figures["faults_lost"] == figures["soak_lost"] == figures["reload_failed_requests"] == 0
    assert figures["faults_counters_reconcile"] == figures["soak_counters_reconcile"] == 1
    assert figures["soak_rate_per_s"] == pytest.approx(0.8 * figures["soak_capacity_per_s"], rel=0.01)
    assert figures["slowloris_408s"] == figures["slowloris_slow_heads"]
    assert figures["reload_applied"] == 2 and figures["reload_refused"] == 2
