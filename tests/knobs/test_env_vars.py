"""VELOCITY_* environment variables act on a running `velocityllm serve`, below flags and
above the config file (precedence flag > environment > file > default)."""

from __future__ import annotations

import json
import time
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest

from tests.support.gateway import gateway_process
from tests.support.sim import sim_engine


def _get(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = Request(url, json.dumps(body).encode() if body is not None else None, headers)
    try:
        with urlopen(req, timeout=15) as r:
            return r.status, json.loads(r.read())
    except HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


@pytest.mark.timeout(60)
def test_environment_sets_keys_of_a_serve_process(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "policy: static\nmax_concurrency: 9\nmax_model_len: 1000\napi_key: file-key\n"
        "health: {check_interval_ms: 100, scrape_interval_ms: 50}\n"
    )
    with sim_engine(model="m1", time_scale=50) as eng:
        env = {
            "VELOCITY_CONFIG": str(cfg),  # the file, by environment
            "VELOCITY_ENDPOINTS": f"e1={eng.url}=m1",  # endpoints without a flag
            "VELOCITY_POLICY": "smart",  # beats the file's static
            "VELOCITY_MAX_CONCURRENCY": "3",  # beats the file's 9
            "VELOCITY_API_KEY": "env-key",  # beats file-key ...
            "VELOCITY_PORT": "1",
        }  # ... and a flag beats this
        with gateway_process("serve", env=env) as gp:
            assert gp.port != 1
            deadline = time.monotonic() + 10
            while (health := _get(gp.url + "/health")[1])["status"] != "ok":
                assert time.monotonic() < deadline, "the engine never became healthy"
                time.sleep(0.05)
            assert health["policy"] == "smart"
            assert _get(gp.url + "/v1/models", "file-key")[0] == 401
            status, models = _get(gp.url + "/v1/models", "env-key")
            assert status == 200
            assert models["data"][0]["max_model_len"] == 1000  # from the file: no variable set
            chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            status, out = _get(gp.url + "/v1/chat/completions", "env-key", chat)
            assert status == 200 and out["usage"]["completion_tokens"] == 3
            status, stats = _get(gp.url + "/stats", "env-key")
            assert stats["policy"] == "smart" and stats["admission"]["limits"] == {"e1": 3}
