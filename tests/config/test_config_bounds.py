"""Every number of the configuration has a range, and an error says where the bad value
came from and which key it is, in one form: ``<source>: <key>: <why>``, the source being
the flag, the VELOCITY_* variable or the file (docs/configuration.md, "Errors").

The same form at start (a config error, exit 2) and on a refused reload (one log line,
the running configuration kept).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gateway import running_gateway
from tests.support.sim import http_request, sim_engine
from velocity_fast.config import ConfigError, load_settings
from velocity_fast.gateway.reload import Reloader

FORM = re.compile(r"^(?P<source>[^:]+): (?P<key>[\w.\[\]<>]+): (?P<why>.+)$")


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def error_of(config: str | None = None, flags: dict | None = None, env: dict | None = None) -> str:
    with pytest.raises(ConfigError) as ei:
        load_settings(config, flags or {}, env=env or {})
    msg = str(ei.value)
    assert "\n" not in msg and FORM.match(msg), f"not <source>: <key>: <why>: {msg!r}"
    return msg


# -- the rate limit (0 once made every request after the first a 500) ---------------------------


@pytest.mark.parametrize(
    "tenant, key, why",
    [
        ("{name: a, requests_per_second: 0, burst: 1}", "tenants[0].requests_per_second", "(0, 1000000], got 0"),
        ("{name: a, requests_per_second: -5}", "tenants[0].requests_per_second", "got -5"),
        ("{name: a, requests_per_second: .inf}", "tenants[0].requests_per_second", "got inf"),
        ("{name: a, requests_per_second: .nan}", "tenants[0].requests_per_second", "got nan"),
        ("{name: a, requests_per_second: 1, burst: 0}", "tenants[0].burst", "[1, 1000000000], got 0"),
        ("{name: a, weight: 0}", "tenants[0].weight", "got 0"),
        ("{name: a, sla_ms: -1}", "tenants[0].sla_ms", "got -1"),
    ],
)
def test_a_rate_limit_that_cannot_refill_is_refused(tmp_path, tenant, key, why):
    f = write(tmp_path, f"tenants:\n  - {tenant}\n")
    assert error_of(f).startswith(f"{f}: {key}: must be "), error_of(f)
    assert why in error_of(f)


async def test_retry_after_of_a_slow_rate_is_at_most_a_day():
    """The smallest rates allowed give waits of years: the header says a day, never a 500."""
    tenants = [{"name": "slow", "api_key": "k", "requests_per_second": 1e-9, "burst": 1}]
    with sim_engine(model="m1", time_scale=50) as eng:
        async with running_gateway(eng, tenants=tenants) as gw:
            body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
            hdrs = {"authorization": "Bearer k", "content-type": "application/json"}
            first = await http_request(gw.port, "POST", "/v1/chat/completions", body, headers=hdrs)
            second = await http_request(gw.port, "POST", "/v1/chat/completions", body, headers=hdrs)
    assert first.status == 200, first.body
    assert second.status == 429 and second.headers["retry-after"] == "86400", (second.status, second.headers)


# -- the source and the full key -----------------------------------------------------------------


def test_a_flag_is_named_as_the_flag_not_as_defaults():
    assert error_of(flags={"sla_ms": -1}) == "--sla-ms: sla_ms: must be a number in (0, 86400000], got -1"
    assert error_of(flags={"port": 70000}).startswith("--port: port: must be an integer in [0, 65535]")
    msg = error_of(flags={"endpoints": [{"name": "e", "url": "https://h:1", "model": "m"}]})
    assert msg.startswith("--endpoint: endpoints[0].url: must start with http://"), msg


def test_a_flag_beats_the_file_in_the_message_too(tmp_path):
    f = write(tmp_path, "sla_ms: 500\nmax_concurrency: 4\n")
    assert error_of(f, flags={"sla_ms": 0}).startswith("--sla-ms: sla_ms: ")
    assert error_of(f, flags={"max_concurrency": 0}).startswith("--max-concurrency: max_concurrency: ")


def test_an_environment_variable_is_named(tmp_path):
    f = write(tmp_path, "port: 1000\n")
    assert error_of(f, env={"VELOCITY_SLA_MS": "-3"}).startswith("VELOCITY_SLA_MS: sla_ms: must be a number")
    assert error_of(env={"VELOCITY_PORT": "many"}) == "VELOCITY_PORT: port: expected int, got 'many'"
    assert error_of(env={"VELOCITY_ENDPOINTS": "a=http"}).startswith("VELOCITY_ENDPOINTS: endpoints: ")


@pytest.mark.parametrize(
    "text, key",
    [
        ("admission:\n  tick_ms: fast\n", "admission.tick_ms: expected float, got 'fast'"),
        ("admission:\n  tick_ms: 0\n", "admission.tick_ms: must be a number in [1, 60000], got 0"),
        ("admission:\n  bogus: 1\n", "admission.bogus: unknown key"),
        ("routing:\n  block_bytes: 50\n", "routing.block_bytes: must be an integer in [32, 65536], a multiple of 32"),
        ("routing:\n  saturation_kv: 2\n", "routing.saturation_kv: must be a number in (0, 1], got 2"),
        ("server:\n  max_bodybytes: 1\n", "server.max_bodybytes: unknown key"),
        ("server:\n  header_timeout_s: 0\n", "server.header_timeout_s: must be a number in [0.001, 86400], got 0"),
        ("health:\n  scrape_interval_ms: 0.001\n", "health.scrape_interval_ms: must be a number in [1, 86400000]"),
        ("bands:\n  - {name: x, ceiling: -1}\n", "bands[0].ceiling: must be a number in (0, 1000], got -1"),
        ("tenants:\n  - {api_key: k}\n", "tenants[0].name: required, missing"),
        ("sla_ms: .inf\n", "sla_ms: must be a number in (0, 86400000], got inf"),
    ],
)
def test_a_file_error_names_the_file_and_the_full_key(tmp_path, text, key):
    f = write(tmp_path, text)
    assert error_of(f).startswith(f"{f}: {key}"), error_of(f)


def test_the_command_line_says_it_in_the_same_form():
    r = subprocess.run(
        [sys.executable, "-m", "velocity_fast", "serve", "--sla-ms", "-1", "--endpoint", "e1=http://127.0.0.1:9=m"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip() == "velocityllm: config error: --sla-ms: sla_ms: must be a number in (0, 86400000], got -1.0"
    ), r.stderr


async def test_a_refused_reload_logs_file_key_why(tmp_path, caplog):
    with sim_engine(model="m1", time_scale=50) as eng:
        f = tmp_path / "gw.yaml"
        f.write_text(f"endpoints:\n  - {{name: e1, url: '{eng.url}', model: m1}}\n")
        async with running_gateway(eng) as gw:
            reloader = Reloader(gw, lambda: load_settings(str(f), {}, env={}))
            for text, line in [
                (
                    "tenants:\n  - {name: a, requests_per_second: 0}\n",
                    "tenants[0].requests_per_second: must be a number in (0, 1000000], got 0",
                ),
                ("admission: {tick_ms: fast}\n", "admission.tick_ms: expected float, got 'fast'"),
            ]:
                f.write_text(f"endpoints:\n  - {{name: e1, url: '{eng.url}', model: m1}}\n{text}")
                caplog.clear()
                with caplog.at_level(logging.ERROR, "velocity.reload"):
                    assert await reloader.reload() is False
                refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
                assert refusals == [f"config reload refused, the running configuration stays in force: {f}: {line}"], (
                    refusals
                )
            reloader.close()


def test_a_sim_section_its_engines_would_refuse_stops_charge_velocity_naming_it(tmp_path):
    """The example's own mistake: KV blocks too few for one sequence of max_model_len. Said
    as a config error before any engine starts, not as an engine that exits."""
    f = write(tmp_path, "max_model_len: 131072\nsim: {num_gpu_blocks: 2048}\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "velocity_fast",
            "chargeVelocity",
            "--mock",
            "--config",
            f,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--admin-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.startswith(
        f"velocityllm: config error: {f}: sim: --max-model-len 131072 needs 8192 KV blocks but --num-gpu-blocks is 2048"
    ), r.stderr
