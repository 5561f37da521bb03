"""What some command-line flags do, as a user of the command would notice it:

- ``velocityllm loadgen``: ``--num-requests`` (the report counts exactly N), ``--concurrency``
  (never more than C requests in flight at the server), ``--timeout`` (a server that never
  answers: every request ends as a timeout after about S seconds, and the command ends);
- ``velocityllm bench``: ``--no-plots`` (no PNG next to --output), ``--stats-interval`` (the
  spacing and number of /stats samples in the JSON timeline), ``--ready-timeout`` (a gateway
  whose engines are still loading: the bench gives up after about that long, exit 1);
- ``velocityllm sim-engine``: ``--max-num-batched-tokens`` (a small chunked-prefill budget
  makes a long prompt's first token later) and ``--natural-output-mean`` (the mean reply
  length of requests without max_tokens).

Every server and process a test starts is stopped by it; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import csv
import json
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.gateway import ScriptedServer, velocity_command
from tests.support.sim import REPO, http_request, sim_engine

REPLY = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class CountingServer(ScriptedServer):
    """Answers every request after ``hold`` seconds (or never, with ``answer=False``), and
    records how many requests it received and the most it held at once."""

    def __init__(self, hold: float = 0.0, answer: bool = True) -> None:
        super().__init__()
        self.hold = hold
        self.answer = answer
        self.received = 0
        self.inflight = 0
        self.peak = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await self.read_request(reader)
            self.received += 1
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            try:
                if not self.answer:
                    await asyncio.Event().wait()  # until the client leaves or the server stops
                await asyncio.sleep(self.hold)
            finally:
                self.inflight -= 1
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(REPLY)}\r\n\r\n".encode()
                + REPLY
            )
            await writer.drain()


async def run_cli(*args: str, timeout: float) -> tuple[int, str, str, float]:
    """``velocityllm ARGS`` as a child process: (exit code, stdout, stderr, seconds it ran).
    The child is killed if it outlives ``timeout``."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *velocity_command(*args), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - t0


def loadgen_args(url: str, prefix: Path, *extra: str) -> list[str]:
    return [
        "loadgen",
        "--url",
        url,
        "--pattern",
        "flood",
        "--no-progress",
        "--prompt-tokens",
        "8",
        "--output-tokens",
        "4",
        "--output",
        str(prefix),
        *extra,
    ]


def read_report(prefix: Path) -> tuple[dict, list[dict]]:
    """(the JSON summary, the CSV rows) that ``--output PREFIX`` wrote."""
    summary = json.loads(Path(f"{prefix}.json").read_text())["summary"]
    with open(f"{prefix}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return summary, rows


# -- velocityllm loadgen ------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_loadgen_num_requests_is_the_number_sent_and_reported(tmp_path):
    for n in (5, 17):
        async with CountingServer() as srv:
            prefix = tmp_path / f"n{n}"
            rc, out, err, _ = await run_cli(*loadgen_args(srv.url, prefix, "--num-requests", str(n)), timeout=40)
            assert rc == 0, err
            assert srv.received == n
        summary, rows = read_report(prefix)
        assert summary["requests"] == n and summary["completed"] == n and summary["failed"] == 0
        assert len(rows) == n and sorted(int(r["index"]) for r in rows) == list(range(n))
        assert f"requests {n}  completed {n}" in out


@pytest.mark.timeout(90)
async def test_loadgen_concurrency_bounds_requests_in_flight(tmp_path):
    peaks = {}
    for c in (3, 9):
        # Each answer takes 0.3 s and all 18 requests arrive at once: only the client's
        # bound keeps them from all being in flight together.
        async with CountingServer(hold=0.3) as srv:
            prefix = tmp_path / f"c{c}"
            rc, _, err, _ = await run_cli(
                *loadgen_args(srv.url, prefix, "--num-requests", "18", "--concurrency", str(c)), timeout=40
            )
            assert rc == 0, err
            assert srv.received == 18
            peaks[c] = srv.peak
        summary, _ = read_report(prefix)
        assert summary["completed"] == 18
    assert peaks[3] <= 3 and peaks[9] <= 9, peaks
    assert peaks[3] >= 2 and peaks[9] >= 5, peaks  # the bound, not something else, limited them


@pytest.mark.timeout(90)
async def test_loadgen_timeout_ends_unanswered_requests(tmp_path):
    waited = {}
    for s in (0.5, 2.0):
        async with CountingServer(answer=False) as srv:
            prefix = tmp_path / f"t{s}"
            rc, _, err, wall = await run_cli(
                *loadgen_args(srv.url, prefix, "--num-requests", "3", "--concurrency", "3", "--timeout", str(s)),
                timeout=40,
            )
            assert srv.received == 3  # they reached the server: it is the answer that never came
        # No request got an answer: the command says so and fails, but it does end.
        assert rc == 1 and "no response" in err and "timeout" in err, err
        assert wall < s + 30
        summary, rows = read_report(prefix)
        assert summary["completed"] == 0 and summary["failed"] == 3
        assert summary["rejections"]["by_reason"] == {"timeout": 3}
        assert all(r["status"] == "0" and r["reason"] == "timeout" for r in rows)
        lat = [float(r["latency_ms"]) / 1000.0 for r in rows]
        assert all(0.9 * s <= x <= 3 * s + 1.0 for x in lat), (s, lat)
        waited[s] = statistics.median(lat)
    ratio = waited[2.0] / waited[0.5]
    assert 2.0 < ratio < 6.0, waited


# -- velocityllm bench -------------------------------------------------------------------------

BENCH_TINY = [
    "bench",
    "--num-requests",
    "12",
    "--pattern",
    "constant",
    "--duration",
    "2",
    "--policies",
    "dynamic",
    "--repeats",
    "1",
    "--warmup-requests",
    "0",
    "--engines",
    "1",
    "--prompt-tokens",
    "16",
    "--output-tokens",
    "4",
    "--concurrency",
    "16",
    "--no-progress",
]


def run_bench(*extra: str, timeout: float = 150) -> tuple[int, str, str, float]:
    """A tiny bench as a child process (its gateway dies with it if the test kills it)."""
    t0 = time.monotonic()
    p = subprocess.run(
        velocity_command(*BENCH_TINY, *extra),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def two_benches(tmp_path_factory):
    """Run A: plots on, /stats every 0.1 s; run B: --no-plots, /stats every 0.5 s."""
    runs = {}
    for name, extra in (("a", ["--stats-interval", "0.1"]), ("b", ["--stats-interval", "0.5", "--no-plots"])):
        out_dir = tmp_path_factory.mktemp(f"bench_{name}")
        rc, out, err, _ = run_bench("--output", str(out_dir / "res"), *extra)
        assert rc == 0, out + err
        runs[name] = (out_dir, out, json.loads((out_dir / "res.json").read_text()))
    return runs


@pytest.mark.timeout(330)
def test_bench_no_plots_writes_no_png(two_benches):
    from velocity_fast.loadgen.plots import have_matplotlib

    out_dir, out, doc = two_benches["b"]
    assert doc["runs"][0]["summary"]["requests"] == 12
    assert sorted(p.name for p in out_dir.iterdir()) == ["res.csv", "res.json", "res_runs.csv"]
    assert ".png" not in out and "matplotlib" not in out

    out_dir, out, _ = two_benches["a"]
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    if have_matplotlib():
        assert pngs == ["res_latency_cdf.png", "res_timeline.png"]
        for name in pngs:
            data = (out_dir / name).read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 2000
            assert name in out
    else:  # without the bench extra the bench says why there are none
        assert pngs == [] and "matplotlib not installed" in out


@pytest.mark.timeout(330)
def test_bench_stats_interval_sets_the_sampling_of_stats(two_benches):
    seen = {}
    for name, interval in (("a", 0.1), ("b", 0.5)):
        run = two_benches[name][2]["runs"][0]
        times = [s[0] for s in run["timeline"]]
        expect = run["summary"]["duration_s"] / interval
        # A sample, then a sleep of the interval: never more than duration/interval (+ the
        # first sample and rounding); a slow /stats read on a busy machine may give fewer.
        assert 0.25 * expect <= len(times) <= expect + 2, (name, len(times), expect)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert len(gaps) >= 2
        gap = statistics.median(gaps)
        assert interval * 0.95 <= gap <= interval * 3 + 0.1, (name, gap)
        # The samples hold the gateway's gauges (sum of limits, queued, in flight).
        assert all(len(s) == 4 for s in run["timeline"])
        seen[name] = (len(times), gap)
    assert seen["a"][0] >= 2 * seen["b"][0], seen
    assert 1.5 < seen["b"][1] / seen["a"][1] < 8, seen


@pytest.mark.timeout(120)
def test_bench_ready_timeout_gives_up_on_a_gateway_that_is_not_ready(tmp_path):
    # Its engines take two minutes to "load the model": the gateway never gets ready in time.
    rc, out, err, wall = run_bench(
        "--output",
        str(tmp_path / "res"),
        "--ready-timeout",
        "3",
        "--server-arg=--sim-args=--startup-delay 120",
        timeout=100,
    )
    assert rc == 1, out + err
    assert "not ready after 3 s" in err and "a gateway failed" in err, err
    assert not (tmp_path / "res.json").exists()
    # At least the 3 s it was told to wait; far less than the default 60 s (the rest is
    # process start and stopping the gateway).
    assert 3.0 <= wall < 45, wall


# -- velocityllm sim-engine -------------------------------------------------------------------


def _prompt(i: int, tokens: int) -> str:
    """A distinct prompt of ``tokens`` tokens (4 bytes each) per ``i``: no prefix-cache hits."""
    head = f"request {i:04d} "
    return head + "x" * (4 * tokens - len(head))


@pytest.mark.timeout(90)
async def test_sim_max_num_batched_tokens_chunks_a_long_prompt():
    # 2048 prompt tokens; a step lasts 1/20/2 = 25 ms; prefill itself is near free, so the
    # first token comes after ceil(2048 / budget) steps: 1 with budget 4096, 16 with 128.
    took = {}
    for budget in (4096, 128):
        with sim_engine(
            "--max-num-batched-tokens", str(budget), "--prefill-tps", "1000000", "--decode-tps", "20", time_scale=2
        ) as eng:
            times = []
            for i in range(3):
                t0 = time.perf_counter()
                r = await http_request(
                    eng.port,
                    "POST",
                    "/v1/completions",
                    {"model": "sim-model", "prompt": _prompt(budget + i, 2048), "max_tokens": 1},
                    timeout=20,
                )
                times.append(time.perf_counter() - t0)
                assert r.status == 200, r.body
                assert r.json()["usage"]["prompt_tokens"] == 2048
            took[budget] = statistics.median(times)
    assert took[128] >= 0.9 * 16 * 0.025, took
    ratio = took[128] / took[4096]
    assert 4 < ratio < 48, took


@pytest.mark.timeout(90)
async def test_sim_natural_output_mean_sets_the_mean_reply_length():
    means = {}
    for mean in (8, 64):
        with sim_engine("--natural-output-mean", str(mean), "--decode-tps", "200", time_scale=20) as eng:
            replies = await asyncio.gather(
                *(
                    http_request(
                        eng.port, "POST", "/v1/completions", {"model": "sim-model", "prompt": _prompt(i, 8)}, timeout=30
                    )
                    for i in range(16)
                )
            )
        lengths = []
        for r in replies:
            assert r.status == 200, r.body
            doc = r.json()
            assert doc["choices"][0]["finish_reason"] == "stop"  # it ended by itself
            lengths.append(doc["usage"]["completion_tokens"])
        means[mean] = statistics.mean(lengths)
        assert mean / 3 <= means[mean] <= mean * 3, (mean, lengths)
    assert 3 < means[64] / means[8] < 20, means
