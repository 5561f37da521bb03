"""`velocityllm serve` as a process: bad configs are one line and exit 2; a good one serves
and stops on SIGTERM; structured logs are JSON lines."""

from __future__ import annotations

import json
import signal
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest

from tests.support.gateway import GatewayProcess, gateway_process
from tests.support.sim import sim_engine

BAD_CONFIGS = {
    "unknown-key": ("port: 8000\nprot: 8001\n", "prot"),
    "wrong-type": ("max_concurrency: lots\n", "max_concurrency"),
    "rising-ceilings": (
        ("bands:\n  - {name: high, ceiling: 1.0}\n  - {name: normal, ceiling: 1.0}\n  - {name: low, ceiling: 1.3}\n"),
        "bands[2].ceiling",
    ),
    "invalid-yaml": ("port: 8000\nendpoints: [\n  {name: a\n", "invalid YAML"),
    "nested-unknown": ("server:\n  max_body: 10\n", "max_body"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_file_exits_2_with_one_line(tmp_path, name):
    text, key = BAD_CONFIGS[name]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    gp = GatewayProcess("serve", "--config", str(cfg), "--endpoint", "e1=http://127.0.0.1:9=m")
    try:
        gp.spawn()
        code = gp.wait(30)
        err = gp.stderr_text.strip()
    finally:
        gp.close()
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert key in lines[0] and str(cfg) in lines[0]
    assert "Traceback" not in err


def test_serve_without_endpoints_exits_2(tmp_path):
    gp = GatewayProcess("serve")
    try:
        gp.spawn()
        assert gp.wait(30) == 2
        assert "endpoint" in gp.stderr_text
    finally:
        gp.close()


def _get(url: str, headers: dict | None = None, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    with urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), json.loads(r.read())


def test_serve_proxies_and_stops_on_sigterm(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("api_key: from-file\nhealth: {check_interval_ms: 100}\n")
    with sim_engine(model="m1", time_scale=50) as eng:
        with gateway_process(
            "serve",
            "--config",
            str(cfg),
            "--endpoint",
            f"e1={eng.url}=m1",
            "--api-key",
            "flag-key",
            "--structured-logs",
        ) as gp:
            status, _, health = _get(gp.url + "/health")
            assert status == 200 and health["backend"] == "endpoints"
            # the flag beats the file
            status, headers, out = _get(
                gp.url + "/v1/chat/completions",
                {"authorization": "Bearer flag-key"},
                {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            )
            assert status == 200 and headers["x-velocity-endpoint"] == "e1"
            assert out["usage"]["completion_tokens"] == 3
            with pytest.raises(HTTPError) as ei:
                _get(gp.url + "/v1/models", {"authorization": "Bearer from-file"})
            ei.value.close()
            assert ei.value.code == 401
            gp.proc.send_signal(signal.SIGTERM)
            assert gp.wait(15) == 0
            logs = [ln for ln in gp.stderr_text.splitlines() if ln.strip()]
            assert logs, "the gateway logs its start"
            for ln in logs:
                rec = json.loads(ln)
                assert {"timestamp", "level", "logger", "request_id", "message"} <= set(rec)
