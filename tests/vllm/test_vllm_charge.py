"""The README's "With a real vLLM on CPU": its `velocityllm chargeVelocity --engine vllm`
line, run as written (ports moved off 8000/9090 through the environment the README
documents, nothing on PATH), starts a real vLLM CPU engine from the checkout's .vllm-venv
and the gateway in front; a chat completion comes back from vLLM through the gateway."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
import urllib.request

import pytest

from tests.vllm.support.engines import MODELS, ROOT
from velocity_fast.engines.plan import default_log_dir
from velocity_fast.harness.ports import free_port_range
from velocity_fast.harness.procs import start, stop

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

START_S = 300.0
# vLLM 0.32's CPU worker dies when its very first batch is a prompt of two or three tokens.
PROMPT = "the gateway keeps work until an engine has room for it, then sends it on. " * 2


def readme_command() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## With a real vLLM on CPU", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    line = next(x for x in block.splitlines() if "chargeVelocity" in x)
    return shlex.split(line.split(" #", 1)[0])


def test_the_readmes_charge_velocity_engine_vllm_serves_through_the_gateway(vllm_pairs, tmp_path):
    vllm_pairs.close()  # one vLLM engine at a time on this machine: the shared pair goes first
    cmd = readme_command()
    assert cmd[0] == ".venv/bin/velocityllm" and (ROOT / cmd[cmd.index("--model-path") + 1]).parent == MODELS
    cmd[0] = str(ROOT / cmd[0])
    port = free_port_range(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VELOCITY_")}
    env.update(
        PYTHONPATH=str(ROOT),
        VELOCITY_HOST="127.0.0.1",
        VELOCITY_PORT=str(port),
        VELOCITY_ADMIN_PORT=str(port + 1),
        PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin",
    )
    out = tmp_path / "charge.log"
    proc = start(cmd, log=out, append=False, cwd=str(ROOT), env=env)
    try:
        deadline = time.monotonic() + START_S
        while (
            time.monotonic() < deadline
            and proc.poll() is None
            and b"velocityllm chargeVelocity" not in out.read_bytes()
        ):
            time.sleep(0.5)
        assert b"velocityllm chargeVelocity" in out.read_bytes(), out.read_text(errors="replace")[-4000:]
        assert "engines:  vllm: vllm-cpu-0" in out.read_text()  # one engine by default on CPU
        body = json.dumps(
            {"model": "chatml", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            got = json.loads(r.read())
        # vLLM's own answer: its fingerprint, the served name, the 8 tokens asked for.
        assert got["system_fingerprint"].startswith("vllm-") and got["model"] == "chatml"
        assert got["usage"]["completion_tokens"] == 8 and got["choices"][0]["finish_reason"] == "length"
        log = (default_log_dir() / "vllm-cpu-0.log").read_text(errors="replace")
        started = [x for x in log.splitlines() if x.startswith("=== ")][-1]
        assert ".vllm-venv/bin/python -m vllm.entrypoints.openai.api_server" in started
        assert "--enforce-eager" in started and "--dtype bfloat16" in started
    finally:
        stop(proc, 60.0, whole=True, kill_grace=10.0)
    assert proc.returncode == 0, out.read_text(errors="replace")[-4000:]
