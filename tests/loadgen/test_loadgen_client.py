"""The load generator against bench/upstream_fixed.py on 127.0.0.1: fast enough, SSE
timing right, reports written, failures counted."""

import argparse
import csv
from pathlib import Path

import orjson
import pytest

from tests.support.bench import fixed_upstream
from velocity_fast.harness.ports import free_port
from velocity_fast.loadgen.app import loadgen_main
from velocity_fast.loadgen.bench_cmd import BENCH_DEFAULTS, peak_rate
from velocity_fast.loadgen.flags import add_loadgen_arguments
from velocity_fast.loadgen.mix import Mix, parse_dist
from velocity_fast.loadgen.runner import run_workload
from velocity_fast.loadgen.stats import summarize
from velocity_fast.loadgen.workload import WorkloadConfig, build_workload


@pytest.fixture
def fixed():
    with fixed_upstream() as port:
        yield port


@pytest.fixture
def fixed_stream():
    with fixed_upstream("--stream-chunks", "6", "--chunk-interval-ms", "10") as port:
        yield port


async def test_sustains_five_times_the_bench_peak_rate(fixed):
    need = 5 * peak_rate(BENCH_DEFAULTS["num_requests"], BENCH_DEFAULTS["duration"], BENCH_DEFAULTS["pattern"])
    n = 3000
    specs = build_workload(
        WorkloadConfig(num_requests=n, pattern="flood", duration=0.0, seed=1),
        Mix(prompt_tokens=parse_dist(BENCH_DEFAULTS["prompt_tokens"])),
    )
    out = await run_workload(specs, "127.0.0.1", fixed, concurrency=64, timeout=30)
    s = summarize(specs, out.results, start=out.start, cpu_seconds=out.cpu_seconds)
    assert s["completed"] == n
    assert s["throughput_rps"] >= need, f"{s['throughput_rps']:.0f} req/s < {need:.0f}"
    # Also paced: the burst pattern at 5x the bench rate is sent on schedule.
    paced = build_workload(
        WorkloadConfig(
            num_requests=BENCH_DEFAULTS["num_requests"],
            pattern="burst",
            duration=BENCH_DEFAULTS["duration"] / 5,
            seed=2,
        ),
        Mix(),
    )
    out = await run_workload(paced, "127.0.0.1", fixed, concurrency=256, timeout=30)
    s = summarize(paced, out.results, start=out.start, cpu_seconds=out.cpu_seconds)
    assert s["completed"] == len(paced)
    # Kept pace: the last request left close to its time, and the median one on time
    # (wide margins: the machine is shared, and a descheduled moment is not a limit).
    last_sent = max(r.sent for r in out.results) - out.start
    assert last_sent < 1.5 * paced[-1].at + 0.25, f"sent until {last_sent:.2f} s, planned {paced[-1].at:.2f} s"
    # A pacer that broke sends seconds late; a loaded 2-core machine, tens of ms.
    assert s["client_wait_ms"]["p50"] < 100.0, s["client_wait_ms"]


async def test_sse_ttft_and_itl_against_the_stream(fixed_stream):
    specs = build_workload(
        WorkloadConfig(num_requests=20, pattern="constant", duration=0.5, seed=3), Mix(stream_share=1.0)
    )
    out = await run_workload(specs, "127.0.0.1", fixed_stream, concurrency=8, timeout=30)
    s = summarize(specs, out.results, start=out.start)
    assert s["completed"] == 20
    assert all(r.output_tokens == 6 and len(r.gaps) == 5 for r in out.results)
    # Tokens are 10 ms apart (the role chunk comes 10 ms before the first token).
    assert 5.0 < s["itl_ms"]["p50"] < 50.0
    assert 5.0 < s["ttft_ms"]["p50"] < 50.0
    assert s["latency_ms"]["p50"] > 50.0


async def test_refused_connections_are_counted_not_raised():
    specs = build_workload(WorkloadConfig(num_requests=5, pattern="flood", duration=0.0, seed=0), Mix())
    out = await run_workload(specs, "127.0.0.1", free_port(), concurrency=2, timeout=5)
    s = summarize(specs, out.results, start=out.start)
    assert s["completed"] == 0 and s["rejections"]["by_status"] == {"0": 5}
    assert list(s["rejections"]["by_reason"]) == ["ConnectionRefusedError"]


def run_cli(*argv):
    p = argparse.ArgumentParser()
    add_loadgen_arguments(p)
    return loadgen_main(p.parse_args(list(argv)))


def test_cli_prints_summary_and_writes_json_and_csv(fixed_stream, tmp_path, capsys):
    prefix = str(tmp_path / "run")
    rc = run_cli(
        "--url",
        f"http://127.0.0.1:{fixed_stream}",
        "-n",
        "40",
        "--pattern",
        "poisson",
        "--rate",
        "200",
        "--stream-share",
        "0.5",
        "--bands",
        "high:1,low:1",
        "--seed",
        "9",
        "--output",
        prefix,
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "throughput" in text and "loadgen cost:" in text and "TTFT ms" in text
    summary = orjson.loads(Path(prefix + ".json").read_bytes())["summary"]
    assert summary["completed"] == 40 and set(summary["by_band"]) == {"high", "low"}
    with open(prefix + ".csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 and {r["status"] for r in rows} == {"200"}
    assert all((r["ttft_ms"] != "") == (r["stream"] == "1") for r in rows)


def test_cli_exit_codes(capsys):
    assert run_cli("--url", f"http://127.0.0.1:{free_port()}", "-n", "2", "--pattern", "flood") == 1
    assert run_cli("--url", "https://example.invalid", "-n", "2") == 2
    assert "only http://" in capsys.readouterr().err


def test_cli_shows_the_first_error_of_each_status_and_fails_when_nothing_completed(capsys):
    """`loadgen --model gpt-4` against an engine that serves another model: every request
    is a 404; the report says what the server said, and the exit code is not 0."""
    from tests.support.sim import sim_engine

    with sim_engine(model="m1") as eng:
        rc = run_cli("--url", eng.url, "--model", "gpt-4", "-n", "5", "--pattern", "flood", "--no-progress")
        out = capsys.readouterr()
        assert rc == 1
        assert "not completed by status: 404: 5" in out.out
        assert "first error with status 404: The model `gpt-4` does not exist." in out.out
        assert "no request completed (404: The model `gpt-4` does not exist.)" in out.err
        # One that completes is still a success: exit 0.
        assert run_cli("--url", eng.url, "--model", "m1", "-n", "2", "--pattern", "flood", "--no-progress") == 0


async def test_rejections_by_status_and_reason_and_stream_errors():
    from velocity_fast.server.http_server import HTTPServer

    async def handler(req, resp):
        i = int(req.headers["x-request-id"].rsplit("-", 1)[1])
        if b'"stream":true' in req.body:
            resp.start(200)
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
            await resp.write(b'data: {"error":{"message":"engine died","code":500}}\n\ndata: [DONE]\n\n')
            resp.end()
        elif i % 3 == 1:
            resp.send_error(503, "queue full", headers=[("x-velocity-reject-reason", "capacity"), ("retry-after", "1")])
        elif i % 3 == 2:
            resp.send_error(429, "cannot meet SLA", headers=[("x-velocity-reject-reason", "sla")])
        else:
            resp.send_json(
                200,
                {"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 7}},
                headers=[("x-velocity-endpoint", "e1")],
            )

    srv = HTTPServer(handler, name="reject-test")
    await srv.start("127.0.0.1", 0)
    try:
        specs = build_workload(WorkloadConfig(num_requests=30, pattern="flood", duration=0.0, seed=4), Mix())
        streamed = build_workload(
            WorkloadConfig(num_requests=3, pattern="flood", duration=0.0, seed=5), Mix(stream_share=1.0)
        )
        out = await run_workload(specs, "127.0.0.1", srv.port, concurrency=4, timeout=10)
        s = summarize(specs, out.results, start=out.start)
        out2 = await run_workload(streamed, "127.0.0.1", srv.port, concurrency=3, timeout=10)
        s2 = summarize(streamed, out2.results, start=out2.start)
    finally:
        await srv.shutdown(grace=1.0)
    assert s["completed"] == 10 and s["good"] == 10
    assert s["rejections"]["by_status"] == {"429": 10, "503": 10}
    assert s["rejections"]["by_reason"] == {"capacity": 10, "sla": 10}
    assert s["rejections"]["first_error"] == {"429": "cannot meet SLA", "503": "queue full"}
    assert {r.endpoint for r in out.results if r.ok} == {"e1"}
    assert all(r.output_tokens == 7 for r in out.results if r.ok)
    assert s2["completed"] == 0 and s2["rejections"]["by_reason"] == {"stream-error": 3}
    assert s2["rejections"]["first_error"] == {"200": "engine died"}
    assert all(r.error == "engine died" and r.status == 200 for r in out2.results)
