"""``velocityllm bench`` end to end: real gateways with sim engines on 127.0.0.1."""

import csv
import subprocess
import sys
from pathlib import Path

import orjson

from velocity_fast.cli import build_parser
from velocity_fast.loadgen.bench_cmd import bench_setup, run_config, run_order
from velocity_fast.loadgen.gateway_proc import gauges

ROOT = Path(__file__).resolve().parents[2]


def bench(*argv, timeout):
    return subprocess.run(
        [sys.executable, "-m", "velocity_fast", "bench", "--no-progress", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_run_order_is_seeded_and_visits_every_policy_per_repeat():
    order = run_order(["static", "dynamic", "smart"], 4, seed=1)
    assert order == run_order(["static", "dynamic", "smart"], 4, seed=1)
    for r in range(4):
        assert sorted(p for rr, p in order if rr == r) == ["dynamic", "smart", "static"]
    assert len({tuple(p for rr, p in order if rr == r) for r in range(4)}) > 1


def test_bench_help_says_where_the_results_go_by_default():
    import argparse

    from velocity_fast.loadgen.bench_cmd import add_bench_arguments

    p = argparse.ArgumentParser(prog="velocityllm bench")
    add_bench_arguments(p)
    assert p.get_default("output") == "bench/results/policies"
    text = " ".join(p.format_help().split())
    assert "relative to the current folder, whose folder is made if missing (default bench/results/policies)" in text


def test_the_json_config_records_the_duration_that_ran():
    """--rate sets the duration to N / rate: the JSON says 2.0 s, not the --duration default."""
    args = build_parser().parse_args(["bench", "-n", "20", "--rate", "10"])
    cfg = bench_setup(args)[0]
    assert cfg.duration == 2.0 and cfg.pattern == "burst"
    assert run_config(args, cfg)["duration"] == 2.0 and run_config(args, cfg)["pattern"] == "burst"


def test_the_policy_bench_sends_what_real_clients_send_by_default():
    """The bench's default workload has requests without max_tokens (and without
    ignore_eos), with vLLM's "priority": 0, and with temperature and stop, beside the seeded
    ones; the flags set the shares, 0 sends plain bodies only."""
    specs = bench_setup(build_parser().parse_args(["bench"]))[2]
    bodies = [orjson.loads(s.body) for s in specs]
    assert 0.15 < sum("max_tokens" not in b for b in bodies) / len(bodies) < 0.45
    assert all("ignore_eos" not in b for b in bodies if "max_tokens" not in b)
    assert 0.15 < sum(b.get("priority") == 0 for b in bodies) / len(bodies) < 0.45
    assert 0.35 < sum("temperature" in b and "stop" in b for b in bodies) / len(bodies) < 0.65
    plain = bench_setup(
        build_parser().parse_args(
            ["bench", "--no-max-tokens-share", "0", "--priority-zero-share", "0", "--sampling-share", "0"]
        )
    )[2]
    assert all(
        {"max_tokens", "ignore_eos"} <= set(orjson.loads(s.body))
        and "priority" not in orjson.loads(s.body)
        and "stop" not in orjson.loads(s.body)
        for s in plain
    )


def test_gauges_read_limits_inflight_and_queue():
    stats = {
        "endpoints": [{"limit": 32, "inflight": 3}, {"limit": 20, "inflight": 1}],
        "admission": {"bands": {"high": {"queued": 2}, "low": {"queued": 5}}},
    }
    assert gauges(stats) == (52.0, 7.0, 4.0)
    assert gauges({}) == (None, None, None)


def test_small_bench_writes_table_json_csv_and_plots(tmp_path):
    prefix = tmp_path / "pol"
    p = bench(
        "-n",
        "16",
        "--duration",
        "1",
        "--repeats",
        "1",
        "--warmup-requests",
        "2",
        "--prompt-tokens",
        "16",
        "--output-tokens",
        "4",
        "--policies",
        "static,dynamic",
        "--output",
        str(prefix),
        timeout=100,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "runs"])
    assert {lines[header + 2].split()[0], lines[header + 3].split()[0]} == {"static", "dynamic"}
    assert any(line.startswith("dynamic: ") and "vs static" in line for line in lines)
    doc = orjson.loads((tmp_path / "pol.json").read_bytes())
    assert set(doc["medians"]) == {"static", "dynamic"}
    assert {r["policy"] for r in doc["runs"]} == {"static", "dynamic"}
    assert all(r["summary"]["requests"] == 16 for r in doc["runs"])
    # Each run sampled the gateway's /stats: the engines' limits are known.
    assert all(r["timeline"] and r["timeline"][0][1] for r in doc["runs"])
    with open(tmp_path / "pol.csv", newline="") as f:
        assert {row["policy"] for row in csv.DictReader(f)} == {"static", "dynamic"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed: no plots" in p.stdout
        return
    for name in ("pol_latency_cdf.png", "pol_timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
