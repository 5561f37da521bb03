"""bench/soak.py: its fd accounting (what each fd is, and the verdict on growth and on the
pool's bound, on samples made up here so that each failure is seen to be caught) and a
short soak through a real gateway, which must meet the verdict: no kind of fd but the
engine pool grows after the first stretch, and the pool stays within its bound."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import KINDS, classify, verdict

REPO = Path(__file__).resolve().parents[2]


def _sample(t: float, **counts) -> dict:
    c = {k: counts.get(k, 0) for k in KINDS}
    return {"t": t, "counts": c, "fds": {k: [f"fd {100 + i}: made-up {k} fd" for i in range(n)] for k, n in c.items()}}


def _steady(n: int = 40, **over) -> list[dict]:
    """Every 5 s for n samples: 10 client, 8 pool, 1 store, 14 other; ``over``: kind ->
    fds added at each sample after 60 s (a leak of that kind)."""
    out = []
    for i in range(n):
        t = 5.0 * i
        extra = {k: (i - 12) * v if t > 60 else 0 for k, v in over.items()}
        out.append(
            _sample(
                t,
                client=10 + extra.get("client", 0),
                pool=8 + extra.get("pool", 0),
                store=1 + extra.get("store", 0),
                other=14 + extra.get("other", 0),
            )
        )
    return out


@pytest.mark.timeout(30)
def test_a_steady_run_meets_the_verdict_and_the_pool_may_grow_within_its_bound():
    ok, problems = verdict(_steady(), 60.0, 100)
    assert ok, problems
    ok, problems = verdict(_steady(pool=2), 60.0, 100)  # the pool grows to 62: within 100
    assert ok, problems


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["client", "store", "other"])
def test_a_kind_that_grows_after_the_first_minute_fails_naming_its_fds(kind):
    ok, problems = verdict(_steady(**{kind: 1}), 60.0, 100)
    assert not ok
    (line,) = problems
    assert line.startswith(f"{kind}: ") and f"made-up {kind} fd" in line, line


@pytest.mark.timeout(30)
def test_one_more_store_or_other_fd_than_in_the_first_minute_fails_but_a_client_may_breathe():
    samples = _steady()
    samples[30]["counts"]["other"] += 1
    samples[31]["counts"]["client"] += 3
    ok, problems = verdict(samples, 60.0, 100)
    assert not ok and len(problems) == 1 and problems[0].startswith("other: passed"), problems


@pytest.mark.timeout(30)
def test_client_fds_are_judged_beyond_the_connections_the_load_holds_open():
    # The load's own connections grow (kept-alive ones filling up, more in flight on a slow
    # moment): the gateway's client fds follow them, and that is no leak.
    samples = _steady(client=1)
    for s in samples:
        s["held"] = s["counts"]["client"] - 1
    ok, problems = verdict(samples, 60.0, 100)
    assert ok, problems
    # The same fds while the load holds a steady 10: the gateway keeps what clients closed.
    for s in samples:
        s["held"] = 10
    ok, problems = verdict(samples, 60.0, 100)
    assert not ok and problems[0].startswith("client: grew") and "held open" in problems[0], problems


@pytest.mark.timeout(30)
def test_a_pool_past_its_bound_fails_naming_its_connections():
    ok, problems = verdict(_steady(pool=1), 60.0, 20)
    assert not ok and problems[0].startswith("pool: ") and "past its bound 20" in problems[0], problems


@pytest.mark.timeout(30)
def test_each_fd_is_named_by_kind_through_its_socket_ports():
    lst = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    port, other_port = lst.getsockname()[1], other.getsockname()[1]
    conns = [socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", other_port))]
    accepted = [lst.accept()[0], other.accept()[0]]
    try:
        fds = classify(os.getpid(), {"client": {port}, "pool": {other_port: "e1"}, "store": None, "events": set()})
        # This process is both ends: the accepted side is on the client port (client), the
        # connecting side's remote port is the "engine"'s (pool), the listeners are other.
        assert any(f"client connection :{port} <-" in d for d in fds["client"]), fds
        assert any("engine e1 connection" in d and f"-> :{other_port}" in d for d in fds["pool"]), fds
        assert any(f"tcp listening on :{port}" in d for d in fds["other"]), fds
        assert not fds["store"] and not fds["events"]
    finally:
        for s in conns + accepted + [lst, other]:
            s.close()


@pytest.mark.serial  # three sim engines, a gateway and a load client
@pytest.mark.bench
@pytest.mark.timeout(300)
def test_a_short_soak_through_the_gateway_meets_the_verdict(tmp_path):
    """75 s at 70 % of the measured capacity (bench.soak --smoke), the first stretch 20 s:
    no kind of the gateway's fds but the engine pool grows after it, and the pool stays
    within max_concurrency + 2 per engine. A failure prints what each fd is."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--smoke", "--output", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["completed"] > 0 and res["failed"] == 0, {
        k: res[k] for k in ("ok", "completed", "failed", "failed_why")
    }
    assert len(res["samples"]) >= 12
    assert all(c is not None and c["open"] <= c["max_idle"] for c in res["connections"].values()), res["connections"]
