"""`velocityllm serve --workers 2` in front of two sim engines (docs/operations.md, "Workers").

Both workers accept on the one client port; the admin port reports the whole gateway;
SIGHUP reaches every worker; a worker killed under load loses only its own in-flight
requests and is replaced; SIGTERM drains every worker and the supervisor exits 0.
Every process a test starts (engines, the supervisor and its workers) is stopped by it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import pytest

from tests.support.gateway import gateway_process
from tests.support.sim import sim_engine

pytestmark = [pytest.mark.e2e]

FAST_HEALTH = "health: {check_interval_ms: 100, scrape_interval_ms: 50, check_timeout_ms: 500}\n"


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except HTTPError as e:
        with e:
            return e.code, e.read()


def _stats(gp) -> dict:
    return json.loads(_get(gp.admin_url + "/stats")[1])


def _complete(gp, max_tokens: int = 4, timeout: float = 30) -> int:
    body = json.dumps({"model": "m1", "prompt": "hello", "max_tokens": max_tokens}).encode()
    req = Request(gp.url + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except HTTPError as e:
        with e:
            return e.code
    except (URLError, ConnectionError, OSError):
        return 0  # the connection ended without an answer


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not yet reaped is no running worker
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _config(tmp_path, eng1, eng2, extra: str = "") -> str:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"endpoints:\n  - {{name: e1, url: '{eng1.url}', model: m1}}\n"
        f"  - {{name: e2, url: '{eng2.url}', model: m1}}\n" + FAST_HEALTH + extra
    )
    return str(cfg)


def _ready(gp) -> bool:
    return _get(gp.admin_url + "/ready")[0] == 200


@pytest.mark.timeout(120)
def test_two_workers_share_the_port_and_the_admin_port_reports_both(tmp_path):
    with (
        sim_engine(model="m1", time_scale=20) as e1,
        sim_engine(model="m1", time_scale=20) as e2,
        gateway_process("serve", "--config", _config(tmp_path, e1, e2), "--workers", "2") as gp,
    ):
        assert "2 workers" in gp.stdout_text
        _wait(lambda: _ready(gp), 20, "/ready 200")
        # New connections each: the kernel spreads them between the two listening workers.
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda _: _complete(gp), range(60)))
        assert statuses.count(200) == 60, statuses
        stats = _stats(gp)
        assert stats["workers"] == {"count": 2, "alive": 2, "restarts": 0}
        per = stats["per_worker"]
        assert sorted(p["worker"] for p in per) == [0, 1]
        served = [sum(e["served"] for e in p["endpoints"]) for p in per]
        assert all(n > 0 for n in served) and sum(served) == 60, served
        assert sum(e["served"] for e in stats["endpoints"]) == 60
        assert [e["name"] for e in stats["endpoints"]] == ["e1", "e2"]
        metrics = _get(gp.admin_url + "/metrics")[1].decode()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("velocity_requests_total{") and 'status="200"' in line
        )
        assert total == 60
        assert "velocity_workers 2.0" in metrics
        # Both workers check the same engine: the family declares MAX, so the whole is 1, not 2.
        assert 'velocity_endpoint_healthy{endpoint="e1",model="m1"} 1.0' in metrics
        assert "# MERGE" not in metrics
        assert "velocity_worker_restarts_total 0.0" in metrics
        assert _get(gp.admin_url + "/health")[0] == 200


@pytest.mark.timeout(120)
def test_sighup_reaches_every_worker(tmp_path):
    with sim_engine(model="m1", time_scale=20) as e1, sim_engine(model="m1", time_scale=20) as e2:
        cfg = _config(tmp_path, e1, e2, "tenants:\n  - {name: t1, requests_per_second: 5}\n")
        with gateway_process("serve", "--config", cfg, "--workers", "2") as gp:
            _wait(lambda: _ready(gp), 20, "/ready 200")
            assert [p["tenants"]["t1"]["requests_per_second"] for p in _stats(gp)["per_worker"]] == [5, 5]
            with open(cfg) as f:
                text = f.read()
            with open(cfg, "w") as f:
                f.write(text.replace("requests_per_second: 5", "requests_per_second: 7"))
            gp.proc.send_signal(signal.SIGHUP)
            _wait(
                lambda: [p["tenants"]["t1"]["requests_per_second"] for p in _stats(gp)["per_worker"]] == [7, 7],
                15,
                "both workers to reload",
            )
            assert gp.proc.poll() is None


@pytest.mark.timed  # failures timed against the kill
@pytest.mark.timeout(150)
def test_a_worker_killed_under_load_loses_only_its_in_flight_requests(tmp_path):
    with (
        sim_engine(model="m1", time_scale=1) as e1,
        sim_engine(model="m1", time_scale=1) as e2,
        gateway_process("serve", "--config", _config(tmp_path, e1, e2), "--workers", "2") as gp,
    ):
        _wait(lambda: _ready(gp), 20, "/ready 200")
        before = {p["worker"]: p["pid"] for p in _stats(gp)["per_worker"]}
        clients = 8
        results: list[tuple[float, int]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                status = _complete(gp, max_tokens=40)  # about 0.8 s at the sim's 50 tokens/s
                with lock:
                    results.append((time.monotonic(), status))

        with ThreadPoolExecutor(clients) as pool:
            for _ in range(clients):
                pool.submit(client)
            try:
                # Served before the kill, and every client with a request in flight again.
                _wait(lambda: sum(s == 200 for _, s in results) >= clients, 30, "a round of answers")
                os.kill(before[1], signal.SIGKILL)
                killed_at = time.monotonic()
                _wait(
                    lambda: (s := _stats(gp))["workers"]["alive"] == 2 and s["workers"]["restarts"] == 1,
                    30,
                    "a new worker",
                )
                # Answers again, and past the second in which a failure may still be the kill's.
                _wait(
                    lambda: (
                        time.monotonic() > killed_at + 2.0
                        and any(t > killed_at + 1.0 and s == 200 for t, s in list(results))
                    ),
                    30,
                    "answers after the kill",
                )
            finally:
                stop.set()
        ok_before = sum(1 for t, s in results if t < killed_at and s == 200)
        failed = [(t - killed_at, s) for t, s in results if s != 200]
        ok_after = sum(1 for t, s in results if t > killed_at + 0.5 and s == 200)
        assert ok_before > 0
        # Only what the dead worker held fails, at the kill: a request per client at most,
        # and a retry whose connection reached the dead worker's socket while the kernel
        # was still closing it (a few ms); none later.
        assert len(failed) <= 2 * clients, failed
        assert all(-0.1 < dt < 1.0 for dt, _ in failed), failed
        assert ok_after > 0
        stats = _stats(gp)
        after = {p["worker"]: p["pid"] for p in stats["per_worker"]}
        assert after[0] == before[0] and after[1] != before[1] and _alive(after[1])
        assert not _alive(before[1])
        metrics = _get(gp.admin_url + "/metrics")[1].decode()
        assert "velocity_worker_restarts_total 1.0" in metrics
        assert "velocity_worker_lost_requests_total" in metrics
        assert _complete(gp) == 200


@pytest.mark.timeout(120)
def test_sigterm_drains_every_worker_and_exits_0(tmp_path):
    with (
        sim_engine(model="m1", time_scale=1) as e1,
        sim_engine(model="m1", time_scale=1) as e2,
        gateway_process("serve", "--config", _config(tmp_path, e1, e2), "--workers", "2") as gp,
    ):
        _wait(lambda: _ready(gp), 20, "/ready 200")
        pids = [p["pid"] for p in _stats(gp)["per_worker"]]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_complete, gp, 100) for _ in range(6)]  # about 2 s each
            time.sleep(0.7)
            gp.proc.send_signal(signal.SIGTERM)
            statuses = [f.result() for f in futures]
        assert statuses == [200] * 6
        assert gp.proc.wait(30) == 0
        assert not any(_alive(p) for p in pids)
        assert not any(n.startswith(f"velocity-{gp.proc.pid}") for n in os.listdir("/dev/shm"))


@pytest.mark.timeout(60)
def test_charge_velocity_refuses_more_than_one_worker_saying_why():
    from tests.support.gateway import GatewayProcess

    gp = GatewayProcess("chargeVelocity", "--mock", "--workers", "2").spawn()
    try:
        assert gp.wait(30) == 2
        assert "config error: --workers: workers: chargeVelocity runs one gateway process" in gp.stderr_text
    finally:
        gp.close()


@pytest.mark.timed  # a rate over a window
@pytest.mark.timeout(120)
def test_a_tenants_rate_holds_once_across_two_workers(tmp_path):
    """A tenant limited to 40 requests/s, with clients over the limit on both workers (a
    new connection each request: the kernel spreads them): the admitted rate is 40/s, not
    twice it. One bucket in the shared state, drawn by both workers with one CAS a draw."""
    rate, seconds = 40, 6.0
    extra = f"tenants:\n  - {{name: t, requests_per_second: {rate}, burst: 10}}\n"
    body = json.dumps({"model": "m1", "prompt": "hello", "max_tokens": 2}).encode()
    headers = {"content-type": "application/json", "x-velocity-tenant": "t"}

    def one(_) -> tuple[float, int]:
        t0 = time.monotonic()
        try:
            with urlopen(Request(gp.url + "/v1/completions", body, headers), timeout=10) as r:
                r.read()
                return t0, r.status
        except HTTPError as e:
            with e:
                e.read()
                if e.code == 429:
                    time.sleep(0.02)
                return t0, e.code

    def load(until: float) -> list[tuple[float, int]]:
        out: list[tuple[float, int]] = []
        lock = threading.Lock()

        def client(_):
            while time.monotonic() < until:
                got = one(None)
                with lock:
                    out.append(got)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(client, range(8)))
        return out

    with (
        sim_engine(model="m1", time_scale=50) as e1,
        sim_engine(model="m1", time_scale=50) as e2,
        gateway_process("serve", "--config", _config(tmp_path, e1, e2, extra), "--workers", "2") as gp,
    ):
        _wait(lambda: _ready(gp), 20, "/ready 200")
        load(time.monotonic() + 1.5)  # the burst spent
        t0 = time.monotonic()
        recs = load(t0 + seconds)
        got = sum(1 for t, s in recs if s == 200 and t0 <= t < t0 + seconds) / seconds
        print(f"\ntwo workers, limit {rate}/s: admitted {got:.2f}/s of {len(recs)} tries")
        assert all(s in (200, 429) for _, s in recs)
        assert sum(s == 429 for _, s in recs) > len(recs) / 3  # the clients were over the limit
        assert abs(got - rate) <= 0.05 * rate, f"admitted {got:.1f}/s across two workers, limit {rate}/s"
        # Both workers admitted the tenant's requests: the one bucket was drawn from both.
        per = _stats(gp)["per_worker"]
        assert all(sum(e["served"] for e in p["endpoints"]) > 0 for p in per), per
