"""deploy/config.example.yaml runs with the commands it advertises, as shipped.

- `velocityllm chargeVelocity --config deploy/config.example.yaml` with `--mock` (sim
  engines, the file's `sim:` section and `max_model_len` passed to them);
- `velocityllm serve --config deploy/config.example.yaml` in front of sim engines.

Only the listening address and ports move (flags) and the file's example endpoints, whose
10.0.0.x addresses must never be contacted from here, are replaced: by the engines
`chargeVelocity` starts (`VELOCITY_ENDPOINTS=` empties the file's list) or by `--endpoint`
flags for `serve`. The file's tenants carry keys, so every request presents one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest

from tests.support.fakes import free_port_block
from tests.support.gateway import gateway_process
from tests.support.sim import sim_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"
KEY = {"authorization": "Bearer key-alpha"}


def call(url: str, body: dict | None = None) -> tuple[int, dict]:
    headers = {**KEY, "content-type": "application/json"}
    req = Request(url, json.dumps(body).encode() if body is not None else None, headers)
    try:
        with urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"{}")


def wait_ready(gp, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while call(gp.admin_url + "/ready")[0] != 200:
        assert gp.proc.poll() is None, f"exited with {gp.proc.returncode}: {gp.stderr_text[-2000:]}"
        assert time.monotonic() < deadline, "never ready: " + gp.stderr_text[-2000:]
        time.sleep(0.1)


def chat(gp, model: str) -> dict:
    status, out = call(
        gp.url + "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
    )
    assert status == 200, out
    return out


def test_charge_velocity_mock_starts_with_the_example_as_shipped():
    base = free_port_block(2)
    with gateway_process(
        "chargeVelocity",
        "--mock",
        "--config",
        str(EXAMPLE),
        "--engine-base-port",
        str(base),
        env={"VELOCITY_ENDPOINTS": ""},
        timeout=90,
    ) as gp:
        wait_ready(gp)
        status, models = call(gp.url + "/v1/models")
        assert status == 200 and len(models["data"]) == 1, models
        model = models["data"][0]
        assert model["max_model_len"] == 131072, model  # the file's max_model_len, given to the engines
        assert chat(gp, model["id"])["usage"]["completion_tokens"] == 4
        assert call(gp.url + "/health")[1]["healthy_endpoints"] == 2


def test_serve_in_front_of_sim_engines_with_the_example_as_shipped():
    with sim_engine(model="llama", time_scale=10) as a, sim_engine(model="llama", time_scale=10) as b:
        with gateway_process(
            "serve",
            "--config",
            str(EXAMPLE),
            "--endpoint",
            f"e1={a.url}=llama",
            "--endpoint",
            f"e2={b.url}=llama",
            timeout=60,
        ) as gp:
            wait_ready(gp)
            assert chat(gp, "llama")["choices"][0]["message"]["content"]
            status, models = call(gp.url + "/v1/models")
            assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("llama", 4096)], models
            assert call(gp.url + "/health")[1]["healthy_endpoints"] == 2
