"""--engine / engine: and --vllm-python: vLLM's CPU build without a GPU, and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fakes import FAKES_DIR, machine_env, make_model_folder
from velocity_fast.engines.detect import GPU
from velocity_fast.engines.errors import PlanError, VllmNotFound
from velocity_fast.engines.models import ModelChoice
from velocity_fast.engines.plan import VLLM_CPU_ENV, plan_engines

NOWHERE = "/nonexistent/python"


@pytest.fixture
def model(tmp_path):
    folder = make_model_folder(tmp_path, "llama-tiny")
    return ModelChoice(folder, folder.name, "--model-path")


@pytest.fixture
def vllm_python(tmp_path):
    """A python that can import a package named vllm (an empty one)."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return str(py)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_cpu_vllm_plan_runs_the_given_python_with_cpu_flags_and_env(model, vllm_python, tmp_path):
    plan = plan_engines(
        [],
        model,
        engine="vllm",
        vllm_python=vllm_python,
        path=str(tmp_path),
        base_port=9500,
        log_dir=tmp_path,
        max_model_len=4096,
        environ={},
    )
    assert plan.kind == "vllm" and len(plan.specs) == 1  # one engine by default on CPU
    assert "without a GPU" in plan.reason
    s = plan.specs[0]
    a = list(s.argv)
    assert a[:5] == [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.path)]
    assert flag(a, "--host") == "127.0.0.1" and flag(a, "--port") == "9500" == str(s.port)
    assert flag(a, "--served-model-name") == "llama-tiny" == s.model_name
    assert flag(a, "--max-model-len") == "4096" and flag(a, "--dtype") == "bfloat16"
    assert "--enforce-eager" in a and "--gpu-memory-utilization" not in a
    assert (
        dict(s.env)
        == VLLM_CPU_ENV
        == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    assert not s.gpus and "CUDA_VISIBLE_DEVICES" not in s.env


def test_cpu_engines_count_ports_and_the_users_own_env(model, vllm_python, tmp_path):
    plan = plan_engines(
        [],
        model,
        engine="vllm",
        vllm_python=vllm_python,
        engines=2,
        base_port=9510,
        log_dir=tmp_path,
        environ={"VLLM_CPU_KVCACHE_SPACE": "8"},
    )
    assert [s.port for s in plan.specs] == [9510, 9511] and len({s.name for s in plan.specs}) == 2
    assert all(s.env["VLLM_CPU_KVCACHE_SPACE"] == "8" and s.env["OMP_NUM_THREADS"] == "1" for s in plan.specs)


def test_cpu_vllm_from_path_runs_vllm_serve(model, tmp_path):
    plan = plan_engines([], model, engine="vllm", path=str(FAKES_DIR), log_dir=tmp_path)
    a = list(plan.specs[0].argv)
    assert a[:3] == [str(FAKES_DIR / "vllm"), "serve", str(model.path)] and "--enforce-eager" in a


def test_the_checkouts_vllm_venv_is_the_last_resort(model, vllm_python, tmp_path):
    plan = plan_engines([], model, engine="vllm", path=str(tmp_path), repo_python=Path(vllm_python), log_dir=tmp_path)
    assert list(plan.specs[0].argv)[:3] == [vllm_python, "-m", "vllm.entrypoints.openai.api_server"]


def test_engine_vllm_without_any_vllm_is_refused_in_one_line(model, tmp_path):
    with pytest.raises(VllmNotFound) as e:
        plan_engines([], model, engine="vllm", path=str(tmp_path), repo_python=Path(NOWHERE))
    assert "no vLLM found" in str(e.value) and "--vllm-python" in str(e.value) and "\n" not in str(e.value)
    # A python that cannot import vllm is no vLLM either, said as such.
    with pytest.raises(VllmNotFound, match="not a python that can import vllm"):
        plan_engines([], model, engine="vllm", vllm_python=sys.executable, path=str(FAKES_DIR))


def test_engine_vllm_needs_a_model_and_contradicts_mock(model, vllm_python):
    with pytest.raises(PlanError, match="needs a model folder"):
        plan_engines([], None, engine="vllm", vllm_python=vllm_python)
    with pytest.raises(PlanError, match="contradict"):
        plan_engines([], model, engine="vllm", mock=True, vllm_python=vllm_python)


def test_auto_and_sim_keep_sims_without_gpu_and_sim_wins_over_gpus(model, vllm_python, tmp_path):
    plan = plan_engines([], model, vllm_python=vllm_python, path=str(FAKES_DIR), log_dir=tmp_path)
    assert plan.kind == "sim" and len(plan.specs) == 2  # auto: vLLM only on GPUs
    plan = plan_engines([GPU(0, "H100", 81559)], model, engine="sim", path=str(FAKES_DIR), log_dir=tmp_path)
    assert plan.kind == "sim" and "--engine sim" in plan.reason


def charge(tmp_path, *argv, config=None):
    env = machine_env(0, tmp_path, HOME=str(tmp_path))
    env["PATH"] = os.path.dirname(sys.executable) + ":/usr/bin:/bin"  # no vllm on it
    cmd = [sys.executable, "-m", "velocity_fast.cli", "chargeVelocity", "--port", "0", "--admin-port", "0", *argv]
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        cmd += ["--config", str(tmp_path / "c.yaml")]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)


def test_charge_velocity_refuses_engine_vllm_without_vllm_at_start(model, tmp_path):
    done = charge(tmp_path, "--engine", "vllm", "--model-path", str(model.path), "--vllm-python", sys.executable)
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr.strip()
    assert err.count("\n") == 0 and "not a python that can import vllm" in err, err
    assert "velocityllm chargeVelocity" not in done.stdout  # nothing was started


def test_the_config_keys_take_effect_as_the_flags_do(model, tmp_path):
    done = charge(tmp_path, "--model-path", str(model.path), config=f"engine: vllm\nvllm_python: {sys.executable}\n")
    assert done.returncode == 2 and "not a python that can import vllm" in done.stderr, done.stderr


def test_an_unknown_engine_kind_is_refused_by_flag_and_by_config(model, tmp_path):
    done = charge(tmp_path, "--engine", "gpu", "--model-path", str(model.path))
    assert done.returncode == 2 and "--engine: invalid choice: 'gpu'" in done.stderr, done.stderr
    done = charge(tmp_path, "--model-path", str(model.path), config="engine: gpu\n")
    assert done.returncode == 2 and "engine: Invalid enum value 'gpu'" in done.stderr, done.stderr
    with pytest.raises(PlanError, match="one of auto, vllm, sim"):
        plan_engines([], model, engine="gpu")
