"""Keys only chargeVelocity's engines read (`model_path`, `engine`, `vllm_python`, a
`sim:` value other than the sim engine's default) do nothing under `serve`, which starts
no engine: `serve` refuses them at start and at a reload, saying why, instead of running
as if they applied. The example config, which lists the sim's defaults, still serves."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gateway import gateway_process, wait_until
from tests.support.sim import sim_engine

pytestmark = pytest.mark.timeout(90)

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "velocity_fast", "serve", "--endpoint", "e1=http://127.0.0.1:9=m", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    "text, keys",
    [
        ("sim:\n  max_num_seqs: 8\n", "sim.max_num_seqs"),
        ("model_path: /models/llama\n", "model_path"),
        ("engine: vllm\nvllm_python: /opt/vllm/bin/python\n", "engine, vllm_python"),
    ],
)
def test_serve_refuses_what_only_chargevelocitys_engines_read(tmp_path, text, keys):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(text)
    r = serve("--config", str(cfg))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"velocityllm: config error: {cfg}: {keys}: only `velocityllm chargeVelocity`"), r.stderr
    assert "would ignore" in r.stderr


def test_an_environment_variable_is_refused_too(tmp_path):
    import os

    r = serve(env={**os.environ, "VELOCITY_MODEL_PATH": "/models/llama"})
    assert r.returncode == 2 and "model_path: only `velocityllm chargeVelocity`" in r.stderr, r.stderr
    assert "VELOCITY_*" in r.stderr


def test_the_sims_defaults_as_the_example_lists_them_are_not_refused():
    from velocity_fast.config import load_settings
    from velocity_fast.gateway.launch import engines_only_keys

    assert engines_only_keys(load_settings(str(EXAMPLE), {}, env={})) == []


async def test_a_reload_that_adds_one_is_refused_and_changes_nothing(tmp_path):
    cfg = tmp_path / "gw.yaml"
    with sim_engine(model="m1", time_scale=20) as eng:
        base = f'endpoints:\n  - {{name: e1, url: "{eng.url}", model: m1}}\n'
        cfg.write_text(base + "sla_ms: 3000\n")
        with gateway_process("serve", "--config", str(cfg), timeout=40) as gp:
            cfg.write_text(base + "sla_ms: 2000\nsim:\n  decode_tps: 10\n")
            gp.proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: "sim.decode_tps" in gp.stderr_text, 15.0, what="the refusal")
            assert "only `velocityllm chargeVelocity`" in gp.stderr_text
            assert "config reloaded" not in gp.stderr_text
            assert gp.proc.poll() is None  # still serving, on the settings it had
