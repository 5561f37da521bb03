"""The vLLM launcher and supervisor on a fake GPU machine: one engine per GPU or per TP
group, readiness on /health, crash restarts with state callbacks, start failures with the
log tail, and no child left behind after stop, SIGTERM, a failing or a killed gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.support.fakes import (
    REPO_ROOT,
    free_port_block,
    machine_env,
    make_model_folder,
    pid_alive,
    wait_until,
)
from velocity_fast.engines.detect import detect_gpus_async
from velocity_fast.engines.errors import EngineStartError
from velocity_fast.engines.models import ModelChoice
from velocity_fast.engines.plan import plan_engines
from velocity_fast.engines.supervisor import EngineSupervisor

FAST = dict(poll_interval=0.05, backoff_initial=0.2, backoff_max=1.0, stop_grace=5.0, ready_timeout=60.0)


@pytest.fixture
def model(tmp_path):
    folder = make_model_folder(tmp_path, "tiny-model")
    return ModelChoice(folder, folder.name, "--model-path")


def group_members(pgids):
    """Live processes (not zombies) whose process group is one of ``pgids``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.append(int(entry))
    return found


async def get(url, timeout=5.0):
    def call():
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()

    return await asyncio.to_thread(call)


async def chat(url, model):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()

    def call():
        req = urllib.request.Request(
            f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())

    return await asyncio.to_thread(call)


async def plan_for(n_gpus_expected, model, tmp_path, tp=1):
    detection = await detect_gpus_async()
    assert detection.count == n_gpus_expected
    groups = n_gpus_expected // tp
    return plan_engines(
        detection.gpus, model, tensor_parallel_size=tp, base_port=free_port_block(groups), log_dir=tmp_path / "logs"
    )


async def test_two_gpus_start_two_engines_with_distinct_devices_and_ports(fake_machine, model, tmp_path):
    machine = fake_machine(2)
    plan = await plan_for(2, model, tmp_path)
    events = []
    sup = EngineSupervisor(plan.specs, on_state_change=lambda n, s: events.append((n, s)), **FAST)
    try:
        await sup.start()
        assert sup.states() == {"vllm-gpu0": "ready", "vllm-gpu1": "ready"}
        launches = machine.launches()
        assert sorted(launch["cuda_visible_devices"] for launch in launches) == ["0", "1"]
        assert len({launch["port"] for launch in launches}) == 2
        by_device = {launch["cuda_visible_devices"]: launch for launch in launches}
        for spec in plan.specs:
            rec = by_device[spec.env["CUDA_VISIBLE_DEVICES"]]
            assert rec["port"] == spec.port and rec["served_model_name"] == ["tiny-model"]
            assert rec["model"] == str(model.path)
        assert [e[1] for e in sup.endpoints()] == [s.url for s in plan.specs]
        for name, url, served in sup.endpoints():
            status, _ = await get(f"{url}/health")
            assert status == 200
            status, body = await chat(url, served)
            assert status == 200 and body["choices"]
        pids = list(sup.pids().values())
        assert len(pids) == 2
    finally:
        await sup.stop()
    assert wait_until(lambda: not group_members(pids), 10)
    assert sup.states() == {"vllm-gpu0": "stopped", "vllm-gpu1": "stopped"}
    for name in ("vllm-gpu0", "vllm-gpu1"):
        assert [s for n, s in events if n == name] == ["starting", "ready", "stopped"]


async def test_tp2_on_four_gpus_gives_two_engines(fake_machine, model, tmp_path):
    machine = fake_machine(4)
    plan = await plan_for(4, model, tmp_path, tp=2)
    async with EngineSupervisor(plan.specs, **FAST) as sup:
        assert len(sup.endpoints()) == 2
        assert set(sup.states().values()) == {"ready"}
        launches = machine.launches()
        assert sorted(launch["cuda_visible_devices"] for launch in launches) == ["0,1", "2,3"]
        for launch in launches:
            argv = launch["argv"]
            assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        pids = list(sup.pids().values())
    assert wait_until(lambda: not group_members(pids), 10)


async def test_a_crashed_engine_is_restarted_while_the_other_keeps_serving(fake_machine, model, tmp_path):
    machine = fake_machine(2, FAKE_VLLM_CRASH_AFTER="1.0", FAKE_VLLM_CRASH_DEVICES="0")
    plan = await plan_for(2, model, tmp_path)
    events = []
    crashed = asyncio.Event()
    back = asyncio.Event()

    def on_state(name, state):
        events.append((name, state))
        if name == "vllm-gpu0" and state == "crashed":
            crashed.set()
        if name == "vllm-gpu0" and state == "ready" and crashed.is_set():
            back.set()

    sup = EngineSupervisor(plan.specs, on_state_change=on_state, **dict(FAST, backoff_initial=1.0))
    try:
        await sup.start()
        other = dict((n, u) for n, u, _ in sup.endpoints())["vllm-gpu1"]
        await asyncio.wait_for(crashed.wait(), 20)
        # Out of routing meanwhile; the other engine answers throughout.
        assert sup.states()["vllm-gpu0"] in ("crashed", "starting")
        served_meanwhile = 0
        while not back.is_set() and served_meanwhile < 200:
            status, _ = await chat(other, "tiny-model")
            assert status == 200
            served_meanwhile += 1
        assert served_meanwhile >= 1
        await asyncio.wait_for(back.wait(), 30)
        assert sup.restarts()["vllm-gpu0"] == 1 and sup.restarts()["vllm-gpu1"] == 0
        status, _ = await chat(dict((n, u) for n, u, _ in sup.endpoints())["vllm-gpu0"], "tiny-model")
        assert status == 200
        gpu0 = [launch for launch in machine.launches() if launch["cuda_visible_devices"] == "0"]
        assert len(gpu0) == 2  # the restart is a new `vllm serve` on the same GPU
    finally:
        await sup.stop()
    assert [s for n, s in events if n == "vllm-gpu0"] == [
        "starting",
        "ready",
        "crashed",
        "starting",
        "ready",
        "stopped",
    ]
    assert [s for n, s in events if n == "vllm-gpu1"] == ["starting", "ready", "stopped"]


async def test_restart_backoff_doubles_while_the_engine_keeps_crashing(fake_machine, model, tmp_path):
    fake_machine(1, FAKE_VLLM_CRASH_AFTER="0.2", FAKE_VLLM_CRASH_TIMES="3")
    plan = await plan_for(1, model, tmp_path)
    events = []
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def on_state(name, state):
        events.append((state, loop.time()))
        if state == "ready" and sum(s == "crashed" for s, _ in events) == 3:
            done.set()

    sup = EngineSupervisor(plan.specs, on_state_change=on_state, **dict(FAST, backoff_initial=0.4, backoff_max=5))
    try:
        await sup.start()
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await sup.stop()
    # The wait between a crash and the next start is the backoff: 0.4, then 0.8, then 1.6 s.
    waits = [b[1] - a[1] for a, b in zip(events, events[1:]) if a[0] == "crashed" and b[0] == "starting"]
    assert len(waits) == 3
    # (less a millisecond: the two clocks' readings round differently)
    assert waits[0] >= 0.399 and waits[1] >= 0.799 and waits[2] >= 1.599
    assert waits[2] < 1.6 * 3  # and not much more: the restart is not stuck
    assert sup.restarts() == {"vllm-gpu0": 3}


async def test_an_engine_that_fails_to_load_raises_with_its_log_tail(fake_machine, model, tmp_path):
    fake_machine(2, FAKE_VLLM_FAIL="torch.OutOfMemoryError: CUDA out of memory while loading weights")
    plan = await plan_for(2, model, tmp_path)
    sup = EngineSupervisor(plan.specs, **FAST)
    with pytest.raises(EngineStartError) as info:
        await sup.start()
    err = info.value
    assert "before answering /health" in str(err)
    assert "CUDA out of memory while loading weights" in err.tail
    assert str(plan.specs[0].log_path.parent) in str(err)
    assert sup.pids() == {} and set(sup.states().values()) == {"stopped"}


async def test_a_model_folder_without_config_json_fails_vllm_with_a_clear_error(fake_machine, tmp_path):
    fake_machine(1)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    plan = await plan_for(1, ModelChoice(bad, bad.name, "test"), tmp_path)
    with pytest.raises(EngineStartError, match="no config.json"):
        await EngineSupervisor(plan.specs, **FAST).start()


async def test_missing_executable_is_a_start_error(tmp_path):
    from velocity_fast.engines.plan import EngineSpec

    spec = EngineSpec("ghost", (str(tmp_path / "nope"),), {}, free_port_block(1), "m", tmp_path / "g.log")
    with pytest.raises(EngineStartError, match="cannot run"):
        await EngineSupervisor([spec], **FAST).start()


# ---- no orphans when the gateway process ends ----------------------------------------


def start_gateway(tmp_path, model_path, then, gpus=2):
    env = machine_env(gpus, tmp_path / "rec", PYTHONPATH=str(REPO_ROOT))
    (tmp_path / "rec").mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.fakes.gateway",
            "--model-path",
            str(model_path),
            "--base-port",
            str(free_port_block(gpus)),
            "--log-dir",
            str(tmp_path / "logs"),
            "--then",
            then,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=str(REPO_ROOT),
    )
    return proc


def read_ready_line(proc):
    line = proc.stdout.readline()
    assert line, proc.stderr.read().decode()
    info = json.loads(line)
    assert info["kind"] == "vllm" and len(info["pids"]) == 2
    return list(info["pids"].values())


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "fail"])
def test_no_child_survives_the_gateway(tmp_path, model, how):
    proc = start_gateway(tmp_path, model.path, "fail" if how == "fail" else "serve")
    pids = []
    try:
        pids = read_ready_line(proc)
        members = group_members(set(pids))
        assert len(members) >= 2 and all(pid_alive(p) for p in pids)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        elif how == "sigkill":
            proc.kill()
            proc.wait(timeout=30)
        else:
            assert proc.wait(timeout=30) == 1
            assert b"the gateway failed" in proc.stderr.read()
        assert wait_until(lambda: not group_members(set(pids)), 15), group_members(set(pids))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        for pid in group_members(set(pids)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_an_engine_that_never_answers_health_is_killed_at_the_ready_timeout(fake_machine, model, tmp_path):
    fake_machine(1, FAKE_VLLM_SIM_ARGS="--startup-delay 60")
    plan = await plan_for(1, model, tmp_path)
    sup = EngineSupervisor(plan.specs, **dict(FAST, ready_timeout=2.0))
    with pytest.raises(EngineStartError, match=r"no /health 200 within 2s"):
        await sup.start()
    assert sup.pids() == {}


async def test_cancelling_start_while_engines_load_leaves_no_child(fake_machine, model, tmp_path):
    machine = fake_machine(2, FAKE_VLLM_SIM_ARGS="--startup-delay 60")
    plan = await plan_for(2, model, tmp_path)
    sup = EngineSupervisor(plan.specs, **FAST)
    task = asyncio.ensure_future(sup.start())
    for _ in range(200):  # both fake vllm processes launched (bounded wait)
        if len(machine.launches()) == 2:
            break
        await asyncio.sleep(0.05)
    pids = {launch["pid"] for launch in machine.launches()}
    assert len(pids) == 2 and sup.states() == {"vllm-gpu0": "starting", "vllm-gpu1": "starting"}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert wait_until(lambda: not group_members(pids), 10)
    assert set(sup.states().values()) == {"stopped"}


async def test_a_failing_state_listener_does_not_stop_supervision(fake_machine, model, tmp_path):
    fake_machine(1)
    plan = await plan_for(1, model, tmp_path)

    def listener(name, state):
        raise ValueError("listener bug")

    async with EngineSupervisor(plan.specs, on_state_change=listener, **FAST) as sup:
        assert sup.states() == {"vllm-gpu0": "ready"}
