"""The engine plan (vLLM per GPU / per TP group, or sim) and `velocityllm detect`."""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

import pytest

import velocity_fast
from tests.support.fakes import FAKES_DIR, make_model_folder
from velocity_fast.engines.app import detect_main, prepare_engines
from velocity_fast.engines.detect import GPU
from velocity_fast.engines.errors import PlanError, VllmNotFound
from velocity_fast.engines.flags import add_engine_arguments
from velocity_fast.engines.models import ModelChoice
from velocity_fast.engines.plan import plan_engines


def gpus(n):
    return [GPU(i, "NVIDIA H100 80GB HBM3", 81559) for i in range(n)]


def args(*argv):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def model(tmp_path):
    folder = make_model_folder(tmp_path, "llama-tiny")
    return ModelChoice(folder, folder.name, "--model-path")


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_one_vllm_engine_per_gpu_with_its_own_device_and_port(model, tmp_path):
    plan = plan_engines(
        gpus(2),
        model,
        base_port=9100,
        log_dir=tmp_path,
        path=str(FAKES_DIR),
        gpu_memory_utilization=0.85,
        max_model_len=8192,
        api_key="k",
    )
    assert plan.kind == "vllm" and len(plan.specs) == 2
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plan.specs] == ["0", "1"]
    assert [s.port for s in plan.specs] == [9100, 9101]
    for s in plan.specs:
        a = list(s.argv)
        assert a[0] == str(FAKES_DIR / "vllm") and a[1:3] == ["serve", str(model.path)]
        assert flag(a, "--port") == str(s.port) and flag(a, "--host") == "127.0.0.1"
        assert flag(a, "--served-model-name") == "llama-tiny" == s.model_name
        assert flag(a, "--tensor-parallel-size") == "1"
        assert flag(a, "--gpu-memory-utilization") == "0.85"
        assert flag(a, "--max-model-len") == "8192"
        assert flag(a, "--api-key") == "k"
        assert s.log_path.parent == tmp_path and s.url == f"http://127.0.0.1:{s.port}"


def test_tensor_parallel_groups_are_consecutive_gpus(model):
    plan = plan_engines(gpus(4), model, tensor_parallel_size=2, path=str(FAKES_DIR))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plan.specs] == ["0,1", "2,3"]
    assert [flag(list(s.argv), "--tensor-parallel-size") for s in plan.specs] == ["2", "2"]
    assert len({s.port for s in plan.specs}) == 2
    assert len({s.name for s in plan.specs}) == 2


def test_gpus_not_divisible_by_tp_is_a_clear_error(model):
    with pytest.raises(PlanError, match="3 GPU.*groups of 2"):
        plan_engines(gpus(3), model, tensor_parallel_size=2, path=str(FAKES_DIR))


def test_vllm_missing_says_to_install_the_gpu_extra(model, tmp_path):
    with pytest.raises(VllmNotFound, match=r"velocityllm\[gpu\]"):
        plan_engines(gpus(1), model, path=str(tmp_path))


@pytest.mark.parametrize(
    "n_gpus, use_model, mock, reason",
    [(0, True, False, "no GPU"), (2, False, False, "no model"), (2, True, True, "--mock")],
)
def test_sim_engines_without_gpu_or_model_or_with_mock(model, n_gpus, use_model, mock, reason):
    plan = plan_engines(
        gpus(n_gpus),
        model if use_model else None,
        mock=mock,
        engines=3,
        base_port=9200,
        sim_args=["--time-scale", "10"],
        path=str(FAKES_DIR),
    )
    assert plan.kind == "sim" and reason in plan.reason
    assert [s.port for s in plan.specs] == [9200, 9201, 9202]
    for s in plan.specs:
        a = list(s.argv)
        # The child runs this very package, never one found in its working folder.
        assert a[:4] == [sys.executable, "-P", "-m", "velocity_fast.sim"]
        assert s.env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(velocity_fast.__file__).parents[1])
        assert flag(a, "--port") == str(s.port) and flag(a, "--time-scale") == "10"
        assert flag(a, "--model") == s.model_name == ("llama-tiny" if use_model else "velocity-sim")
        assert "CUDA_VISIBLE_DEVICES" not in s.env


def test_flags_and_defaults():
    a = args()
    # --engines: None, i.e. 2 sims or 1 vLLM CPU engine; --engine: None, i.e. the config's (auto).
    assert (a.model_path, a.mock, a.engines, a.tensor_parallel_size) == (None, False, None, 1)
    assert (a.engine, a.vllm_python) == (None, None)
    assert (a.gpu_memory_utilization, a.max_model_len, a.engine_base_port) == (0.92, 131072, 8100)
    with pytest.raises(SystemExit):
        args("--gpu-memory-utilization", "1.5")
    with pytest.raises(SystemExit):
        args("--engines", "0")


def test_options_module_imports_nothing_heavy():
    import subprocess

    code = (
        "import sys, velocity_fast.engines.flags; "
        "print(sorted(m for m in sys.modules if m.startswith(('velocity_fast', 'asyncio', 'subprocess'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=str(FAKES_DIR.parents[2])
    ).stdout
    assert "asyncio" not in out and "subprocess" not in out and "velocity_fast.engines.plan" not in out


# ---- velocityllm detect ---------------------------------------------------------------


def run_detect(*argv):
    out = io.StringIO()
    code = detect_main(args(*argv), out=out)
    return code, out.getvalue()


@pytest.mark.parametrize("count", [0, 1, 4])
def test_detect_prints_gpus_model_and_engines(fake_machine, model, tmp_path, count):
    fake_machine(count)
    code, out = run_detect("--model-path", str(model.path), "--engine-base-port", "9300")
    assert code == 0
    if count:
        assert f"GPUs: {count} (via nvidia-smi)" in out
        assert out.count("NVIDIA H100 80GB HBM3, 81559 MiB") == count
        assert f"Engines: {count} x vllm" in out
        assert f"CUDA_VISIBLE_DEVICES={count - 1}" in out and f"127.0.0.1:{9300 + count - 1}" in out
    else:
        assert "GPUs: none" in out
        assert "Engines: 2 x sim (no GPU found" in out
    assert f"Model: llama-tiny at {model.path} (from --model-path)" in out


def test_detect_tp_and_no_model(fake_machine, tmp_path, monkeypatch):
    fake_machine(4)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out = run_detect("--tensor-parallel-size", "2")
    assert code == 0 and "Model: none found" in out and "Engines: 2 x sim (no model found" in out
    make_model_folder(tmp_path / "models", "found-here")
    code, out = run_detect("--tensor-parallel-size", "2")
    assert "(from ./models)" in out and "Engines: 2 x vllm" in out
    assert "CUDA_VISIBLE_DEVICES=0,1" in out and "CUDA_VISIBLE_DEVICES=2,3" in out


def test_detect_exits_2_on_a_model_folder_without_config_json(fake_machine, tmp_path, capsys):
    fake_machine(1)
    code, _ = run_detect("--model-path", str(tmp_path))
    assert code == 2
    assert "has no config.json" in capsys.readouterr().err


def test_detect_exits_0_when_vllm_is_missing(fake_machine, model, monkeypatch, tmp_path):
    fake_machine(1)
    # nvidia-smi stays reachable, vllm does not.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "nvidia-smi").symlink_to(FAKES_DIR / "nvidia-smi")
    monkeypatch.setenv("PATH", f"{shim}:/usr/bin:/bin")
    code, out = run_detect("--model-path", str(model.path))
    assert code == 0 and "GPUs: 1" in out and "velocityllm[gpu]" in out


def test_prepare_engines_with_mock_never_prompts(fake_machine, tmp_path, monkeypatch):
    fake_machine(2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    detection, plan = prepare_engines(args("--mock", "--engines", "1"), interactive=True)
    assert detection.count == 2 and plan.kind == "sim" and len(plan.specs) == 1


def test_velocityllm_detect_command(tmp_path, model):
    import subprocess

    from tests.support.fakes import machine_env

    env = machine_env(4, tmp_path, HOME=str(tmp_path))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "velocity_fast.cli",
            "detect",
            "--model-path",
            str(model.path),
            "--tensor-parallel-size",
            "2",
            "--engine-base-port",
            "9400",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "GPUs: 4 (via nvidia-smi)" in done.stdout
    assert "Engines: 2 x vllm" in done.stdout
    assert "vllm-gpu0-1: http://127.0.0.1:9400" in done.stdout
    assert "vllm-gpu2-3: http://127.0.0.1:9401" in done.stdout


def test_engines_skip_a_port_something_else_holds(model):
    """A port in use (another server, another gateway's engines) is skipped: the engine would
    exit at once, and the readiness check could meet whatever holds the port instead."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        base = held.getsockname()[1]
        plan = plan_engines(gpus(0), None, engines=2, base_port=base)
        ports = [s.port for s in plan.specs]
        assert base not in ports and len(set(ports)) == 2 and all(p > base for p in ports)
        assert all(flag(list(s.argv), "--port") == str(s.port) for s in plan.specs)
    finally:
        held.close()


def test_a_port_with_only_time_wait_connections_is_still_chosen(model):
    """Engines that just stopped leave TIME-WAIT connections on their ports; a restart
    must get the same ports, since the engines' servers bind with SO_REUSEADDR."""
    import socket

    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    port = lsock.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = lsock.accept()
    lsock.close()
    served.close()  # the server side closes first: it is that side's port left in TIME-WAIT
    client.recv(1)  # (the FIN)
    client.close()
    # /proc/net/tcp: local address (hex ip:port) in the second column, state 06 is TIME-WAIT
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    assert any(r[1].endswith(f":{port:04X}") and r[3] == "06" for r in rows), (
        "the test needs a TIME-WAIT connection on the port"
    )
    plan = plan_engines(gpus(0), None, engines=1, base_port=port)
    assert [s.port for s in plan.specs] == [port]
    # ... and the engine's own server can listen there (fdio.listen, as the sim engine binds).
    from velocity_fast.io import fdio

    for s in fdio.listen("127.0.0.1", port):
        s.close()


def test_vllm_gets_at_most_its_models_own_context(tmp_path):
    """vLLM refuses a --max-model-len past the model's max_position_embeddings: the default
    (long, for prompts of 256 KiB) is cut to the model's own, an explicit shorter one kept."""
    folder = tmp_path / "short-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192}')
    short = ModelChoice(folder, "short", "flag")
    plan = plan_engines(gpus(1), short, log_dir=tmp_path, path=str(FAKES_DIR))
    assert flag(list(plan.specs[0].argv), "--max-model-len") == "8192"
    plan = plan_engines(gpus(1), short, max_model_len=2048, log_dir=tmp_path, path=str(FAKES_DIR))
    assert flag(list(plan.specs[0].argv), "--max-model-len") == "2048"


def test_a_sim_engine_has_kv_blocks_for_one_whole_sequence():
    """Without --num-gpu-blocks a sim sized for long prompts can hold one (vLLM would not start
    otherwise); an explicit count is kept, and checked."""
    from velocity_fast.sim.flags import add_arguments
    from velocity_fast.sim.settings import SimConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = SimConfig.from_args(parser.parse_args(["--max-model-len", "131072"]))
    cfg.validate()
    assert cfg.num_gpu_blocks * cfg.block_size >= 131072
    assert SimConfig.from_args(parser.parse_args([])).num_gpu_blocks == SimConfig().num_gpu_blocks
    explicit = SimConfig.from_args(parser.parse_args(["--max-model-len", "131072", "--num-gpu-blocks", "100"]))
    with pytest.raises(ValueError, match="KV blocks"):
        explicit.validate()
