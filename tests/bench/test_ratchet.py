"""The instruction ratchet (bench/ratchet.py): each scenario's machine instructions per
request, counted under callgrind on the in-process harness, at most 3 % above its line in
bench/ratchet.json. Counts, not time: two counts of one tree agree within about 0.5 %,
so the verdict does not move with the machine's load. A change that lowers a count lowers
its line; `python -m bench.ratchet --write` rewrites the file."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.support.bench import bench_module

# Two callgrind runs at a time load both cores; about 40 s alone, 95 s beside other work.
pytestmark = [pytest.mark.serial, pytest.mark.timeout(400)]


def _ratchet():
    return bench_module("ratchet")


def test_the_baseline_names_every_scenario_once_a_line():
    r = _ratchet()
    text = r.BASELINE.read_text()
    base = json.loads(text)
    assert list(base) == list(r.SCENARIOS)
    assert all(isinstance(v, int) and v > 0 for v in base.values())
    # One scenario a line: lowering a baseline is a one-line change.
    assert [line.split(":")[0].strip().strip('"') for line in text.splitlines()[1:-1]] == list(r.SCENARIOS)


def test_a_count_more_than_3_percent_over_its_baseline_fails_and_3_percent_does_not():
    r = _ratchet()
    base = {"a": 10_000, "b": 10_000}
    assert r.over({"a": 10_300, "b": 9_000}, base) == {}
    assert set(r.over({"a": 10_301, "b": 10_000}, base)) == {"a"}


def test_write_keeps_scenario_order_and_the_lines_not_counted(tmp_path):
    r = _ratchet()
    path = tmp_path / "ratchet.json"
    path.write_text(json.dumps({k: 1000 + i for i, k in enumerate(r.SCENARIOS)}))
    first = next(iter(r.SCENARIOS))
    r.write_baseline({first: 1234.4}, path)
    got = json.loads(path.read_text())
    assert list(got) == list(r.SCENARIOS)
    assert got[first] == 1234 and list(got.values())[1:] == [1001 + i for i in range(len(r.SCENARIOS) - 1)]


def test_no_scenario_costs_more_than_3_percent_over_its_baseline():
    if shutil.which("valgrind") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("under CI=true: needs valgrind (.ci/run installs it)")
        pytest.skip("needs valgrind (apt-get install valgrind)")
    r = _ratchet()
    base = r.read_baseline()
    counts = r.count_all(list(r.SCENARIOS))
    table = "; ".join(f"{k} {v:,.0f} against {base[k]:,} ({v / base[k] - 1:+.1%})" for k, v in counts.items())
    assert not r.over(counts, base), (
        "instructions per request over the baseline by more than 3 %: "
        + table
        + ". If the cost is meant, raise its line in bench/ratchet.json and say why."
    )
