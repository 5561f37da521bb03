"""Metrics math on known inputs: percentiles, goodput, rejections, TTFT/ITL."""

import math

import pytest

from velocity_fast.loadgen.client import Result
from velocity_fast.loadgen.compare import format_table, medians, verdict
from velocity_fast.loadgen.stats import distribution, peak_rate_in_window, percentile, summarize
from velocity_fast.loadgen.workload import RequestSpec


def spec(i, sla_ms=100.0, band="", at=0.0):
    return RequestSpec(
        index=i,
        at=at,
        band=band,
        tenant="",
        stream=False,
        prompt_tokens=1,
        max_tokens=1,
        prefix_group=-1,
        sla_ms=sla_ms,
        session="",
        path="/",
        headers={},
        body=b"",
        wire=b"",
    )


def test_percentile_matches_linear_interpolation():
    v = list(range(1, 101))  # 1..100
    assert percentile(v, 50) == pytest.approx(50.5)
    assert percentile(v, 90) == pytest.approx(90.1)
    assert percentile(v, 99) == pytest.approx(99.01)
    assert percentile(v, 0) == 1 and percentile(v, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(v, 101)


def test_distribution_scales_and_sorts():
    d = distribution([0.003, 0.001, 0.002], scale=1000.0)
    assert d["count"] == 3 and d["p50"] == pytest.approx(2.0) and d["max"] == pytest.approx(3.0)
    assert d["mean"] == pytest.approx(2.0)


def test_summary_goodput_rejections_and_streams():
    specs = [spec(i, sla_ms=100.0, band="high" if i < 2 else "low") for i in range(6)]
    start = 1000.0
    results = [
        Result(0, sent=1000.0, done=1000.050, status=200),  # good (50 ms)
        Result(1, sent=1000.0, done=1000.150, status=200),  # completed, late
        Result(
            2, sent=1000.1, done=1000.180, status=200, first_token=1000.12, gaps=[0.01, 0.03], output_tokens=3
        ),  # good stream
        Result(3, sent=1000.2, done=1000.201, status=503, reason="capacity"),
        Result(4, sent=1000.2, done=1000.201, status=429, reason="sla"),
        Result(5, sent=1000.3, done=1001.000, status=200, error="boom"),  # error mid-stream
    ]
    s = summarize(specs, results, start=start, cpu_seconds=0.006)
    assert s["requests"] == 6 and s["completed"] == 3 and s["good"] == 2 and s["failed"] == 3
    assert s["duration_s"] == pytest.approx(1.0)
    assert s["throughput_rps"] == pytest.approx(3.0)
    assert s["goodput_rps"] == pytest.approx(2.0)
    assert s["goodput_ratio"] == pytest.approx(2 / 6)
    assert s["rejections"]["by_status"] == {"200": 1, "429": 1, "503": 1}
    assert s["rejections"]["by_reason"] == {"capacity": 1, "sla": 1, "stream-error": 1}
    assert s["latency_ms"]["p50"] == pytest.approx(80.0)
    assert s["ttft_ms"]["count"] == 1 and s["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert s["itl_ms"]["p50"] == pytest.approx(20.0)
    assert s["client_cpu_us_per_request"] == pytest.approx(1000.0)
    assert s["by_band"]["high"]["good"] == 1 and s["by_band"]["low"]["good"] == 1
    assert s["by_band"]["low"]["requests"] == 4
    # Of the three completed, one finished past its SLA.
    assert s["admitted_miss_ratio"] == pytest.approx(1 / 3)


def test_admitted_past_the_sla_by_load_level():
    """Seconds of the workload split by their arrival rate: 1/s, 4/s and 9/s land in the
    light, middle and peak levels; each level counts its completed past the SLA."""
    specs = (
        [spec(0, at=0.2)]
        + [spec(1 + i, at=1.0 + i / 4) for i in range(4)]
        + [spec(5 + i, at=2.0 + i / 9) for i in range(9)]
    )
    results = [
        Result(
            s.index,
            sent=s.at,
            done=s.at + (0.2 if s.index in (3, 9, 10) else 0.05),
            status=429 if s.index == 13 else 200,
        )
        for s in specs
    ]
    levels = summarize(specs, results, start=0.0)["by_load"]
    assert [(lv["rate_min"], lv["rate_max"], lv["requests"], lv["completed"], lv["missed"]) for lv in levels] == [
        (1, 1, 1, 1, 0),
        (4, 4, 4, 4, 1),
        (9, 9, 9, 8, 2),
    ]
    assert levels[2]["admitted_miss_ratio"] == pytest.approx(2 / 8)


def test_client_wait_is_send_minus_schedule():
    specs = [spec(0, at=0.0), spec(1, at=0.5)]
    results = [Result(0, sent=10.0, done=10.01, status=200), Result(1, sent=10.7, done=10.71, status=200)]
    s = summarize(specs, results, start=10.0)
    assert s["client_wait_ms"]["max"] == pytest.approx(200.0)


def test_policy_medians_and_table():
    def run(policy, g):
        return {"policy": policy, "summary": {"goodput_rps": g, "goodput_ratio": g / 10, "latency_ms": {"p50": 5.0}}}

    runs = [run("static", 1.0), run("static", 3.0), run("static", 2.0), run("dynamic", 4.0)]
    m = medians(runs)
    assert m["static"]["goodput_rps"] == 2.0 and m["static"]["runs"] == 3
    assert m["dynamic"]["latency_p50_ms"] == 5.0 and math.isnan(m["dynamic"]["ttft_p50_ms"])
    table = format_table(m, ["static", "dynamic", "smart"])
    assert table.splitlines()[2].split()[:4] == ["static", "3", "20.0", "2.00"]
    assert "smart" not in table
    assert verdict(m, ["static", "dynamic"]) == [
        "dynamic: 40.0% of requests within SLA (4.00 req/s) vs static 20.0% (2.00 req/s): +20.0 points"
    ]


def test_peak_rate_in_window():
    assert peak_rate_in_window([]) == 0
    times = [0.1 * i for i in range(10)] + [5.0 + 0.01 * i for i in range(30)]
    assert peak_rate_in_window(times) == 30.0
    assert peak_rate_in_window(times, window=0.5) == 60.0
