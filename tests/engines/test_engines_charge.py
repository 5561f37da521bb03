"""`velocityllm chargeVelocity` end to end on a fake GPU machine: the gateway in front of
one fake `vllm serve` per GPU (each a sim engine), traffic through both, a crash that
the other engine covers, and no child process left after any kind of exit."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.fakes import (
    FakeMachine,
    free_port_block,
    machine_env,
    make_model_folder,
    wait_until,
)
from tests.support.procs import stat_fields

SIM_ARGS = "--time-scale 20"


def group_members(pgids):
    """Live processes (not zombies) whose process group is one of ``pgids``."""
    return [pid for pid, fields in stat_fields() if fields[0] != "Z" and int(fields[2]) in pgids]


class Charge:
    """A running `velocityllm chargeVelocity` on 127.0.0.1 with free ports."""

    def __init__(self, tmp_path: Path, gpus: int, *flags: str, **fake_env: str):
        self.tmp = tmp_path
        record = tmp_path / "rec"
        record.mkdir(exist_ok=True)
        self.machine = FakeMachine(gpus, record)
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        env = machine_env(gpus, record, HOME=str(home), **{"FAKE_VLLM_SIM_ARGS": SIM_ARGS, **fake_env})
        for key in list(env):
            if key.startswith("VELOCITY_"):
                del env[key]
        # One block for all: separate draws could hand out the same port twice.
        ports = free_port_block(2 + max(gpus, 2))
        self.port, self.admin = ports, ports + 1
        argv = [
            sys.executable,
            "-m",
            "velocity_fast.cli",
            "chargeVelocity",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin),
            "--engine-base-port",
            str(ports + 2),
            "--engine-log-dir",
            str(tmp_path / "logs"),
            *flags,
        ]
        self.log = open(tmp_path / "charge.out", "w+b")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path))

    def output(self) -> str:
        self.log.flush()
        return (self.tmp / "charge.out").read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready():
            assert self.proc.poll() is None, self.output()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/ready", timeout=2) as r:
                    return r.status == 200
            except (OSError, urllib.error.HTTPError):
                return False

        assert wait_until(ready, timeout, 0.1), self.output()

    def engine_pids(self) -> set[int]:
        return {launch["pid"] for launch in self.machine.launches()}

    def chat(self, timeout: float = 20.0):
        body = json.dumps(
            {"model": "tiny-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                r.read()
                return r.status, r.headers.get("x-velocity-endpoint")
        except urllib.error.HTTPError as e:
            e.read()
            return e.code, e.headers.get("x-velocity-endpoint")
        except (OSError, http.client.HTTPException) as e:
            # The connection itself failed (an engine died mid-response): status 0.
            return 0, repr(e)

    def close(self) -> None:
        pids = self.engine_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for pid in group_members(pids):  # last resort, so a failing test leaves nothing
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


@pytest.fixture
def charge(tmp_path):
    started = []

    def start(gpus, *flags, **env):
        c = Charge(tmp_path, gpus, *flags, **env)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


@pytest.fixture
def model(tmp_path):
    return make_model_folder(tmp_path, "tiny-model")


def test_two_gpus_two_engines_serving_through_the_gateway(charge, model):
    c = charge(2, "--model-path", str(model))
    c.wait_ready()
    launches = c.machine.launches()
    assert sorted(launch["cuda_visible_devices"] for launch in launches) == ["0", "1"]
    assert len({launch["port"] for launch in launches}) == 2
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: c.chat(), range(40)))
    assert all(status == 200 for status, _ in results), results
    assert {ep for _, ep in results} == {"vllm-gpu0", "vllm-gpu1"}
    assert "engines:  vllm: vllm-gpu0" in c.output()


def test_tp2_on_four_gpus_gives_two_engines(charge, model):
    c = charge(4, "--model-path", str(model), "--tensor-parallel-size", "2")
    c.wait_ready()
    assert sorted(launch["cuda_visible_devices"] for launch in c.machine.launches()) == ["0,1", "2,3"]
    status, endpoint = c.chat()
    assert status == 200 and endpoint in ("vllm-gpu0-1", "vllm-gpu2-3")


def test_no_gpu_runs_sim_engines_and_says_so(charge, model):
    c = charge(0, "--model-path", str(model), "--engines", "2")
    c.wait_ready()
    assert "no GPU found: built-in sim engines" in c.output()
    assert c.machine.launches() == []
    assert c.chat()[0] == 200


def test_a_crashed_engine_is_restarted_and_the_other_serves_meanwhile(charge, model):
    c = charge(2, "--model-path", str(model), FAKE_VLLM_CRASH_AFTER="2.0", FAKE_VLLM_CRASH_DEVICES="0")
    c.wait_ready()
    results = []  # (finished at, status, endpoint)

    def gpu0_launches():
        return [launch for launch in c.machine.launches() if launch["cuda_visible_devices"] == "0"]

    def worker():
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            status, ep = c.chat()
            results.append((time.time(), status, ep))
            relaunch = gpu0_launches()[1:]
            if relaunch and any(ep == "vllm-gpu0" and t > relaunch[0]["time"] for t, _, ep in results):
                return  # gpu0 is back in routing after its restart

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(worker) for _ in range(2)]:
            f.result()
    relaunch = gpu0_launches()
    assert len(relaunch) == 2, c.output()
    restart_at = relaunch[1]["time"]
    # The supervisor waits 1 s of backoff between the crash and the relaunch: requests that
    # finished in that window went to the other engine and succeeded.
    during = [(s, ep) for t, s, ep in results if restart_at - 0.8 < t <= restart_at]
    assert during and all(s == 200 and ep == "vllm-gpu1" for s, ep in during), during
    # At most the requests in flight on the engine when it died can fail.
    assert sum(s != 200 for _, s, _ in results) <= 2, results
    assert any(ep == "vllm-gpu0" and t > restart_at for t, _, ep in results)


@pytest.mark.parametrize("how", ["sigterm", "sigint", "sigkill"])
def test_no_engine_outlives_the_gateway(charge, model, how):
    c = charge(2, "--model-path", str(model))
    c.wait_ready()
    pids = c.engine_pids()
    assert len(pids) == 2 and len(group_members(pids)) >= 4  # fake vllm + its sim, per GPU
    sig = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL}[how]
    c.proc.send_signal(sig)
    code = c.proc.wait(timeout=60)
    if how != "sigkill":
        assert code == 0, c.output()
    assert wait_until(lambda: not group_members(pids), 20), group_members(pids)


def test_a_model_folder_without_config_json_is_a_clear_error(charge, tmp_path):
    bad = tmp_path / "half-downloaded"
    bad.mkdir()
    c = charge(2, "--model-path", str(bad))
    assert c.proc.wait(timeout=60) == 2
    assert f"model folder {bad} has no config.json" in c.output()
    assert c.machine.launches() == []


def test_sigterm_while_engines_load_stops_at_once_and_leaves_no_child(charge, model):
    c = charge(2, "--model-path", str(model), FAKE_VLLM_SIM_ARGS="--startup-delay 60")
    assert wait_until(lambda: len(c.machine.launches()) == 2, 30), c.output()
    pids = c.engine_pids()
    assert c.proc.poll() is None
    c.proc.send_signal(signal.SIGTERM)
    try:
        c.proc.wait(timeout=8)
    except subprocess.TimeoutExpired:
        pytest.fail("chargeVelocity ignored SIGTERM while its engines were loading")
    assert wait_until(lambda: not group_members(pids), 20), group_members(pids)
