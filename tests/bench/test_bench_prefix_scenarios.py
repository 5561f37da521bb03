"""bench/prefix.py's scenarios at smoke size: an engine restarted halfway, two gateway
replicas, many tenants over a small cache (every variant completes every request, the
precise one routes on the engines' KV events), one hot prefix, and one hot prefix under
the gateway's default admission."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["restart", "replicas", "tenants"])
def test_precise_scenarios_run_and_complete(tmp_path, scenario):
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.prefix", "--smoke", "--scenario", scenario, "--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "TTFT p90 approximate/precise" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    want = (
        ["precise", "precise-1", "approximate", "approximate-1", "round-robin", "least-loaded"]
        if scenario == "replicas"
        else ["precise", "approximate", "round-robin", "least-loaded"]
    )
    assert [r["variant"] for r in runs] == want
    for r in runs:
        s = r["summary"]
        assert s["completed"] == s["requests"] > 0, (r["variant"], s)
        assert r["ttft_ms_engine_time"]["p90"] > 0 and 0 <= r["engine_hit_rate"] <= 1
    precise = runs[0]
    assert precise["precise_share"] and all(x > 0 for x in precise["precise_share"])
    if scenario == "replicas":
        assert len(precise["precise_share"]) == 2  # two gateways, each routing precisely


@pytest.mark.timeout(240)
def test_repeats_pool_the_runs_and_give_the_goal_run_by_run(tmp_path):
    """--repeats 2: two seeded runs, then each variant's TTFT over both runs' requests
    pooled and the goal's ratio run by run, its median and pooled."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.prefix",
            "--smoke",
            "--scenario",
            "restart",
            "--variants",
            "precise,approximate",
            "--repeats",
            "2",
            "--seed",
            "5",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "-- run 1 of 2, seed 5" in proc.stdout and "-- run 2 of 2, seed 6" in proc.stdout
    assert "2 runs (seeds 5-6), all requests pooled" in proc.stdout
    runs = json.loads(out.read_text())["repeats"]
    assert len(runs) == 2 and all([r["variant"] for r in run] == ["precise", "approximate"] for run in runs)
    pooled = {}
    for line in proc.stdout.split("all requests pooled")[1].splitlines():
        parts = line.split()
        if parts and parts[0] in ("precise", "approximate"):
            assert f"requests {2 * runs[0][0]['summary']['requests']}" in line, line
            pooled[parts[0]] = float(parts[parts.index("p90") + 1])
    # The pooled p90 is the p90 of both runs' samples together, in engine time (x20 at
    # smoke size), interpolated between ranks; printed to the ms. A nearest-rank p90 can
    # sit tens of ms away where the tail has a gap, so the test computes the same one.
    for v in ("precise", "approximate"):
        samples = [x * 20.0 for run in runs for r in run if r["variant"] == v for x in r["ttft_samples_ms"]]
        want = statistics.quantiles(samples, n=10, method="inclusive")[8]
        assert abs(pooled[v] - want) <= 0.51, (v, pooled[v], want)
    per_run = [run[1]["ttft_ms_engine_time"]["p90"] / run[0]["ttft_ms_engine_time"]["p90"] for run in runs]
    assert f"runs {per_run[0]:.2f}x, {per_run[1]:.2f}x" in proc.stdout


@pytest.mark.timeout(240)
def test_the_hot_prefix_scenario_runs_and_carries_its_share():
    """Scenario hot at smoke size: every variant completes; the hot prefix is half the
    traffic (group 0 of the seeded workload), and pure affinity is configured apart."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.prefix", "--smoke", "--scenario", "hot", "--requests", "40"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "TTFT p99 affinity/chat" in proc.stdout and "TTFT p99 gap/chat" in proc.stdout
    for variant in ("chat", "gap", "affinity", "round-robin", "least-loaded"):
        assert f"  {variant} " in proc.stdout


@pytest.mark.timeout(240)
def test_the_hot_prefix_under_admission_scenario_runs_at_defaults_and_reports_its_goal(tmp_path):
    """Scenario hot-admission at smoke size, two seeds: the gateway at its defaults
    (dynamic admission, default profile) against pure affinity; every request completes,
    the hot prefix is group 0, and the goal's ratios are given run by run."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.prefix",
            "--smoke",
            "--scenario",
            "hot-admission",
            "--requests",
            "40",
            "--repeats",
            "2",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "affinity/chat: runs " in proc.stdout and "hit rate chat/affinity: runs " in proc.stdout
    runs = json.loads(out.read_text())["repeats"]
    assert len(runs) == 2
    for run in runs:
        assert [r["variant"] for r in run] == ["chat", "affinity"]
        chat, affinity = run
        for r in run:
            s = r["summary"]
            assert s["completed"] == s["requests"] == 40, (r["variant"], s)
            assert r["latency_ms_engine_time"]["p95"] > 0 and 0 <= r["engine_hit_rate"] <= 1
            assert r["admission"]["limits"] and "gateway_queued_mean" in r["load"]
            groups = [g for _, g, *_ in r["requests"]]
            assert groups.count(0) >= 10  # the hot prefix carries about half of them
        # The default run routes with chat (no models: section), pure affinity with its
        # guard and load weight off: their picks are counted under the chat profile.
        assert set(chat["router"]["picks"]) == {"chat"} and set(affinity["router"]["picks"]) == {"chat"}


@pytest.mark.timed
@pytest.mark.timeout(420)
def test_the_hot_prefix_spreads_under_open_loop_arrivals_from_the_first_second(tmp_path):
    """Scenario hot-open, as a user meets it: fresh engines and gateway at its defaults,
    Poisson arrivals the scenario does not tune, every request judged from the first
    second (no warm-up left out), the fleet at about three quarters of what it serves.
    The engines run twice as fast, the gateway's SLA and scrape interval with them; four
    seeds. Chat answers all but at most 1 % of each run (a 429 here is traffic the engines
    can serve, declined; the full-length bench asks none, and had none in five seeds: at
    twice the speed a prediction at the cold start 24 ms past the halved SLA declined one
    of 1,280), admission learns no batch but the engines' 8, and in every seed where pure
    affinity piled the hot prefix onto one engine, chat's latency p95 is at least 1.5x
    better, but for at most one of three or more such seeds (the bench's four of five),
    which is still 1.25x better. (Pure affinity's first hot requests are sometimes granted in one dispatch pass
    and land on two to four engines before any holds the prefix; the hot prefix then stays
    split, no engine is past its batch and no router is 1.5x better. Which seeds do depends
    on the machine's timing; the bench's goal, four of five at full length, counts them.)

    Before a queue needed a decode step to prove an engine's batch, the engines' first
    cold prefills taught admission batches of 1 to 6 on engines of 8 (4 and 5 in seeds
    2 and 3 of this command): the fleet ran a fraction of its slots, the gateway queued
    (in 48 % of one run's samples) and, at 28 requests/s, declined."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.prefix",
            "--scenario",
            "hot-open",
            "--time-scale",
            "2",
            "--requests",
            "320",
            "--repeats",
            "4",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    runs = json.loads(out.read_text())["repeats"]
    verdicts = []
    for run in runs:
        by = {r["variant"]: r for r in run}
        chat, affinity = by["chat"], by["affinity"]
        ratio = affinity["latency_warm_ms"]["p95"] / chat["latency_warm_ms"]["p95"]
        hot = affinity["group0_per_endpoint"]
        piled = max(hot.values()) >= 0.9 * sum(hot.values())
        verdicts.append((round(ratio, 2), piled, chat["not_ok_by_fifth"], chat["admission"]["batch_capacity"]))
    report = (
        proc.stdout[-2500:] + "\n(ratio, affinity piled the hot prefix on one engine, chat not answered "
        f"by fifth, learned batches) per seed: {verdicts}"
    )
    assert all(sum(fifths) <= 0.01 * 320 for _, _, fifths, _ in verdicts), report
    # What admission learned of each engine's batch (/stats' batch_capacity): its 8 sequences,
    # or not yet shown; never a cold prefill's stall taken for the batch.
    assert all(b in (None, 8.0) for *_, learned in verdicts for b in learned.values()), report
    piled = [ratio for ratio, pile, _, _ in verdicts if pile]
    assert piled, "pure affinity never piled the hot prefix onto one engine: the load was not the case\n" + report
    # The promise is the bench's: at least 1.5x in four runs of five. So every piled seed
    # but one at least 1.5x, and that one still clearly better (beside a CPU-bound
    # process one seed measured 1.48x: 1,788 against 2,655 ms).
    assert sum(ratio < 1.5 for ratio in piled) <= (1 if len(piled) >= 3 else 0), report
    assert all(ratio >= 1.25 for ratio in piled), report


def test_a_hot_prefix_takes_its_share_of_a_seeded_workload():
    from velocity_fast.loadgen.mix import Dist, Mix, Prefix
    from velocity_fast.loadgen.workload import WorkloadConfig, build_workload

    cfg = WorkloadConfig(num_requests=2000, pattern="poisson", duration=10.0, seed=3, route="chat", model="m")
    plain = Mix(prompt_tokens=Dist(value=8), output_tokens=Dist(value=4), prefix=Prefix(groups=8, tokens=16, share=1.0))
    hot = Mix(
        prompt_tokens=Dist(value=8), output_tokens=Dist(value=4), prefix=Prefix(groups=8, tokens=16, share=1.0, hot=0.5)
    )
    groups = [s.prefix_group for s in build_workload(cfg, hot)]
    assert 0.45 < groups.count(0) / len(groups) < 0.55
    assert set(groups) == set(range(8))
    others = [groups.count(g) for g in range(1, 8)]
    assert max(others) < 2 * min(others)
    plain_groups = [s.prefix_group for s in build_workload(cfg, plain)]
    assert plain_groups.count(0) / len(plain_groups) < 0.25  # without hot, group 0 is one of eight
    with pytest.raises(ValueError):
        Mix(prefix=Prefix(groups=1, tokens=16, share=1.0, hot=0.5))


@pytest.mark.timeout(240)
def test_replicas_measure_one_gateway_beside_them_and_give_the_hit_rate_ratio(tmp_path):
    """Scenario replicas at smoke size: each mode also runs through one gateway taking
    every request (``precise-1``, ``approximate-1``), and the two replicas' engine hit rate
    over that one gateway's is printed and written, with the goal for precise.

    Only that the figures exist and agree is asserted here: at smoke size (24 requests,
    4 groups) the cold start is most of the run, so the ratio says nothing about routing.
    Whether the goal holds is a bench result (bench/README.md), not a CI assertion."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.prefix",
            "--smoke",
            "--scenario",
            "replicas",
            "--variants",
            "precise,precise-1,approximate,approximate-1",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    by = {r["variant"]: r for r in data["runs"]}
    assert {v: r["gateways"] for v, r in by.items()} == {
        "precise": 2,
        "precise-1": 1,
        "approximate": 2,
        "approximate-1": 1,
    }
    assert len(by["precise"]["precise_share"]) == 2 and len(by["precise-1"]["precise_share"]) == 1
    for r in by.values():
        assert r["summary"]["completed"] == r["summary"]["requests"] > 0, (r["variant"], r["summary"])
    ratios = data["replicas_vs_one_gateway"]
    for mode in ("precise", "approximate"):
        two, one = by[mode]["engine_hit_rate"], by[mode + "-1"]["engine_hit_rate"]
        assert ratios[mode] == {"two_replicas": two, "one_gateway": one, "ratio": pytest.approx(two / one)}
        assert (
            f"engine hit rate, two {mode} replicas / one {mode} gateway: {100 * two:.1f}% / {100 * one:.1f}% "
            f"= {two / one:.3f}"
        ) in proc.stdout
    assert ratios["goal"] == 0.95 and ratios["met"] == (ratios["precise"]["ratio"] >= 0.95)
    verdict = "met" if ratios["met"] else "NOT met"
    assert f"goal: two precise replicas within 5% of one gateway's hit rate: {verdict}\n" in proc.stdout


@pytest.mark.timed  # a hit-rate ratio of runs under load, 0.967 against 0.95
@pytest.mark.timeout(240)
def test_two_precise_replicas_keep_one_gateways_engine_hit_rate(tmp_path):
    """The replicas goal at the scenario's full size (its defaults: 640 requests, 16
    groups, 4 engines of 288 blocks), precise only: two replicas' engine hit rate at least
    0.95 of one gateway's on the same traffic. About 35 s here. Measured on this 2-core
    machine: 0.972-0.981 over seeds 1-4, 0.967 with one core kept busy by another process.
    The gap is about one prefill per group, the second replica's first request of each
    group, routed before its tokens are ready (docs/kv-events.md, "Replicas")."""
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.prefix",
            "--scenario",
            "replicas",
            "--variants",
            "precise,precise-1",
            "--output",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ratios = json.loads(out.read_text())["replicas_vs_one_gateway"]
    assert ratios["precise"]["one_gateway"] > 0.85, ratios  # the fleet holds the working set: a warm run
    assert ratios["precise"]["ratio"] >= 0.95 and ratios["met"], ratios
