"""The policy comparison on the default sim setup: quick enough, and the adaptive
policies beat the static baseline under an overloading burst, both when every request
carries its own SLA and when none does (the server's SLA applies).

Each runs every policy once (--repeats 1: three gateway runs, about 40 s; the default of
three repeats only takes medians over more of the same), hence the e2e mark and its own
timeout. The verdict is taken on the better of up to two runs (``misses``): the
machine's noise only ever makes a run later (the sims fall behind their pace on a
loaded 2-core machine), and admission without its pace guard is 5-10 % late at a level
in every run, so the second run does not hide one.
"""

import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(out: Path, extra: list[str]) -> tuple[dict, str]:
    """One `velocityllm bench --repeats 1`: (its JSON, the tail of its report)."""
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "velocity_fast",
            "bench",
            "--no-progress",
            "--repeats",
            "1",
            *extra,
            "--output",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    # About 40 s alone; three times that on a loaded machine is still quick. A run that
    # hangs on a gateway or an engine takes the bench's own timeouts, far past it.
    assert took < 150, f"bench took {took:.0f} s"
    doc = orjson.loads(out.with_suffix(".json").read_bytes())
    assert doc["config"]["pattern"] == "burst"
    # The burst peak is well past what the engines delivered at best.
    assert doc["load"]["overload"] >= 1.5, doc["load"]
    return doc, p.stdout[-3000:]


def misses(doc: dict) -> list:
    """Where what the adaptive policies admitted missed its SLA more than allowed: empty
    when the run meets the verdict. What they admit finishes within its SLA at every load
    level of the burst, the peak included, where static, which admits all, misses most of
    it. Work admitted later in a burst slows what runs already (a fuller batch decodes each
    token slower, and on a loaded 2-core machine the sims fall behind their pace):
    admission holds each engine's limit where its pace still meets the deadline work's
    (pace, docs/design.md). Measured 0-2.6 % late a level with it, 5-10 % without; the
    bound leaves noise a margin (two of a level's 38)."""
    late = {run["policy"]: {lv["rate_max"]: lv for lv in run["summary"]["by_load"]} for run in doc["runs"]}
    peak = max(late["static"])
    out = []
    for policy in ("dynamic", "smart"):
        out += [(policy, level) for level in late[policy].values() if level["missed"] > 0.06 * level["completed"]]
        if late[policy][peak]["admitted_miss_ratio"] * 3 > late["static"][peak]["admitted_miss_ratio"]:
            out.append((policy, "peak", late[policy][peak], late["static"][peak]))
    return out


@pytest.mark.timed  # goodput ratios and SLAs met
@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.parametrize("sla", ["per-request", "server"])
def test_bench_is_quick_and_adaptive_policies_beat_static_under_burst(tmp_path, sla):
    # Real clients' bodies (vLLM's priority 0, sampling fields) but every request names its
    # max_tokens: the verdict is that what is admitted ends within its SLA, and a reply with no
    # bound has a length nobody knows at admission (the sims' natural lengths are exponential:
    # a few run 5x the mean). bench/README.md gives the default mix's figures with that share.
    extra = ["--no-max-tokens-share", "0"] + ([] if sla == "per-request" else ["--no-request-sla"])
    doc, report = run_bench(tmp_path / "pol", extra)
    med = doc["medians"]
    assert med["dynamic"]["goodput_ratio"] > med["static"]["goodput_ratio"], report
    assert med["smart"]["goodput_ratio"] > med["static"]["goodput_ratio"], report
    missed = misses(doc)
    if missed:
        print(f"late past the bound, measured again: {missed}")
        doc, report = run_bench(tmp_path / "again", extra)
        missed = misses(doc)
    assert not missed, (missed, report)
