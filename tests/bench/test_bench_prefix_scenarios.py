"""bench/prefix.py's precise scenarios at smoke size: an engine restarted halfway, two
gateway replicas; every variant completes every request, the precise one routes on
the engines' KV events."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["restart", "replicas"])
def test_precise_scenarios_run_and_complete(tmp_path, scenario):
    out = tmp_path / "prefix.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "prefix.py"), "--smoke", "--scenario", scenario,
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "TTFT p90 approximate/precise" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["variant"] for r in runs] == ["precise", "approximate", "round-robin", "least-loaded"]
    for r in runs:
        s = r["summary"]
        assert s["completed"] == s["requests"] > 0, (r["variant"], s)
        assert r["ttft_ms_engine_time"]["p90"] > 0 and 0 <= r["engine_hit_rate"] <= 1
    precise = runs[0]
    assert precise["precise_share"] and all(x > 0 for x in precise["precise_share"])
    if scenario == "replicas":
        assert len(precise["precise_share"]) == 2  # two gateways, each routing precisely
