"""Precise prefix routing without a download: `chargeVelocity --prefix precise` with sim
engines uses the sim's own tokenizer, `sim-engine --write-tokenizer` writes it for engines
started by hand, and a vLLM engine whose model folder holds no tokenizer.json is one line
saying which flags give one."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

from tests.e2e.test_readme import blocks, commands
from tests.support.fakes import free_port_block, machine_env, make_model_folder
from tests.support.gateway import GatewayProcess, gateway_process, stop_group, velocity_command
from tests.support.sim import free_port
from velocity_fast.routing.precise.template import load_tokenizer
from velocity_fast.sim.tokens import PROMPT_WORDS

SYSTEM = " ".join(PROMPT_WORDS) * 8  # loadgen's words: each a token of the sim's tokenizer


def _get(url: str) -> dict:
    with urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _chat(url: str, model: str, user: str) -> None:
    body = {
        "model": model,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }
    req = Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urlopen(req, timeout=10) as r:
        assert r.status == 200


@pytest.mark.timeout(90)
def test_charge_velocity_precise_with_sim_engines_needs_no_tokenizer():
    with gateway_process(
        "chargeVelocity",
        "--mock",
        "--engines",
        "2",
        "--engine-base-port",
        str(free_port_block(2)),
        "--prefix",
        "precise",
        "--sim-args",
        "--time-scale 50 --block-size 16",
        timeout=40,
    ) as gp:
        assert "the sim engines' own tokenizer" in gp.stderr_text
        model = _get(gp.url + "/v1/models")["data"][0]["id"]
        deadline = time.monotonic() + 20
        while True:
            _chat(gp.url, model, f"question {time.monotonic()}")
            kv = _get(gp.admin_url + "/stats")["kv_events"]
            pool = kv["precise"]["pools"].get(model, {})
            blocks = sum(e["blocks"] for e in kv["endpoints"].values())
            # Every engine's subscription has taken its replay (exact), not only the one
            # the first requests went to: on a busy machine the other's comes a moment later.
            exact = all(e["state"] == "exact" for e in kv["endpoints"].values())
            if pool.get("cached") and blocks and kv["precise"]["share"] > 0 and exact:
                break
            assert time.monotonic() < deadline, kv
            time.sleep(0.2)
        assert all(e["state"] == "exact" for e in kv["endpoints"].values()), kv


def test_sim_engine_writes_its_tokenizer_for_engines_started_by_hand(tmp_path):
    out = subprocess.run(
        velocity_command("sim-engine", "--write-tokenizer", str(tmp_path / "tok")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path == str(tmp_path / "tok" / "tokenizer.json")
    tok = load_tokenizer(str(tmp_path / "tok"))  # the folder does, as --tokenizer takes it
    ids = tok.encode("<|im_start|>user " + " ".join(PROMPT_WORDS) + "<|im_end|>").ids
    assert 0 not in ids  # no word unknown, the chat markers special
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")


def test_precise_with_a_vllm_model_folder_without_a_tokenizer_names_what_to_give(tmp_path):
    model = make_model_folder(tmp_path / "models", "my-model")  # config.json, no tokenizer.json
    record = tmp_path / "rec"
    record.mkdir()
    gp = GatewayProcess(
        "chargeVelocity",
        "--model-path",
        str(model),
        "--prefix",
        "precise",
        "--engine-base-port",
        str(free_port_block(2)),
    )
    gp.env = {k: v for k, v in machine_env(1, record).items() if not k.startswith("VELOCITY_")}
    try:
        gp.spawn()
        assert gp.wait(60) == 2
        err = gp.stderr_text
    finally:
        gp.close()
    (line,) = [ln for ln in err.splitlines() if "config error" in ln]
    assert line.startswith("velocityllm: config error: --prefix: model ")
    assert "--tokenizer PATH" in line and "--model-path" in line
    assert "--engines" not in line
    assert not list(record.glob("launch-*.json")), "an engine was started for a config that is refused"


def _doc_commands() -> list[str]:
    """The offline block of docs/kv-events.md, read as the README test reads a block."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "kv-events.md").read_text()
    (block,) = [b for b in blocks(text, "bash") if "--write-tokenizer" in b]
    return commands(block)


@pytest.mark.timeout(90)
def test_the_docs_offline_commands_route_precisely(tmp_path):
    """docs/kv-events.md's three commands, as written but for the folder and ports."""
    write, engine, serve = _doc_commands()
    http, pub, replay = free_port(), free_port(), free_port()
    folder = tmp_path / "simtok"

    def here(cmd: str) -> list[str]:
        # The engine binds its event sockets (`*`, as vLLM), the gateway connects to them.
        for a, b in (
            ("/tmp/simtok", str(folder)),
            ("8100", str(http)),
            ("tcp://*:5557", f"tcp://*:{pub}"),
            ("tcp://*:5558", f"tcp://*:{replay}"),
        ):
            cmd = cmd.replace(a, b)
        args = shlex.split(cmd)
        assert args[0] == "velocityllm"
        return velocity_command(*args[1:])

    made = subprocess.run(here(write), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and made.stdout.strip() == str(folder / "tokenizer.json"), made.stderr
    eng_log = tmp_path / "engine.log"
    with open(eng_log, "wb") as out:
        eng = subprocess.Popen(
            here(engine), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                model = _get(f"http://127.0.0.1:{http}/v1/models")["data"][0]["id"]
                break
            except OSError:
                assert eng.poll() is None and time.monotonic() < deadline, "the sim engine did not start"
                time.sleep(0.1)
        (tmp_path / "gateway.yaml").write_text(
            f"endpoints:\n  - name: e1\n    url: http://127.0.0.1:{http}\n    model: {model}\n"
            f"    kv_events: {{endpoint: 'tcp://127.0.0.1:{pub}', replay_endpoint: 'tcp://127.0.0.1:{replay}', "
            f"topic: kv}}\n"
        )
        args = here(serve)[3:]  # after `python -m velocity_fast`
        args[args.index("gateway.yaml")] = str(tmp_path / "gateway.yaml")
        with gateway_process(*args, timeout=40) as gp:
            deadline = time.monotonic() + 20
            while True:
                _chat(gp.url, model, f"question {time.monotonic()}")
                kv = _get(gp.admin_url + "/stats")["kv_events"]
                if kv["endpoints"]["e1"]["blocks"] and kv["precise"]["pools"].get(model, {}).get("cached"):
                    break
                assert time.monotonic() < deadline, (kv, eng_log.read_text()[-2000:])
                time.sleep(0.2)
            assert kv["endpoints"]["e1"]["state"] == "exact", kv
    finally:
        stop_group(eng)
