"""Configuration (docs/configuration.md): precedence flag > VELOCITY_* env > file > default,
one-line errors that name the key, and the commented example in deploy/."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgspec
import pytest
import yaml

from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.config import (
    BandConfig,
    ConfigError,
    EndpointConfig,
    PdSettings,
    ServerSettings,
    Settings,
    TenantConfig,
    load_settings,
    parse_endpoint_flag,
)
from velocity_fast.fleet.health import HealthSettings
from velocity_fast.fleet.scrape import MetricNames
from velocity_fast.gateway.launch import sim_flags
from velocity_fast.routing.settings import RoutingSettings
from velocity_fast.sim.flags import add_arguments as add_sim_arguments

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


# -- precedence ------------------------------------------------------------------------------


def test_defaults_without_anything():
    s = load_settings(None, {}, env={})
    assert (s.port, s.admin_port, s.policy, s.sla_ms, s.max_concurrency, s.host) == (
        8000,
        9090,
        "dynamic",
        3000.0,
        32,
        "0.0.0.0",
    )
    assert [b.name for b in s.bands] == ["high", "normal", "low"]


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    f = write(tmp_path, "port: 1111\nadmin_port: 2222\nsla_ms: 500\npolicy: static\n")
    env = {"VELOCITY_PORT": "3333", "VELOCITY_SLA_MS": "700"}
    s = load_settings(f, {"port": 4444}, env=env)
    assert s.port == 4444  # flag beats env and file
    assert s.sla_ms == 700.0  # env beats file
    assert s.admin_port == 2222  # file beats default
    assert s.policy == "static"
    assert s.max_concurrency == 32  # default
    assert load_settings(f, {}, env=env).port == 3333
    assert load_settings(f, {}, env={}).port == 1111


def test_flags_that_were_not_given_do_not_override(tmp_path):
    f = write(tmp_path, "port: 1111\n")
    assert load_settings(f, {"port": None, "policy": None}, env={}).port == 1111


def test_env_names_the_config_file_and_converts_types(tmp_path):
    f = write(tmp_path, "max_concurrency: 7\n")
    s = load_settings(
        None,
        {},
        env={
            "VELOCITY_CONFIG": f,
            "VELOCITY_STRUCTURED_LOGS": "true",
            "VELOCITY_ENDPOINTS": "a=http://h:1=m, b=http://h:2=m",
            "OTHER_PORT": "1",
        },
    )
    assert s.max_concurrency == 7
    assert s.structured_logs is True
    assert [(e.name, e.url, e.model) for e in s.endpoints] == [("a", "http://h:1", "m"), ("b", "http://h:2", "m")]


def test_endpoint_flag_parsing():
    assert parse_endpoint_flag("e1=http://10.0.0.5:8000=llama") == EndpointConfig(
        name="e1", url="http://10.0.0.5:8000", model="llama"
    )
    for bad in ("e1=http://x", "=http://x=m", "e1=http://x=m=extra"):
        with pytest.raises(ConfigError, match="--endpoint"):
            parse_endpoint_flag(bad)


def test_endpoint_flags_replace_file_endpoints(tmp_path):
    f = write(tmp_path, "endpoints:\n  - {name: a, url: 'http://h:1', model: m}\n")
    s = load_settings(f, {"endpoints": [parse_endpoint_flag("b=http://h:2=m")]}, env={})
    assert [e.name for e in s.endpoints] == ["b"]


# -- errors: one line, naming the key ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, key",
    [
        ("prot: 8000\n", "prot"),  # unknown key
        ("port: eighty\n", "port"),  # wrong type
        ("server:\n  max_body_bytes: lots\n", "max_body_bytes"),
        ("server:\n  max_bodybytes: 1\n", "max_bodybytes"),
        ("tenants:\n  - {name: a, requests_per_second: fast}\n", "requests_per_second"),
        ("health:\n  metrics:\n    running: 5\n", "running"),
        ("bands:\n  - {name: high, ceiling: 1.0}\n  - {name: low, ceiling: 1.2}\n", "bands[1].ceiling"),
        ("policy: fastest\n", "policy"),
        ("port: 70000\n", "port"),
        ("endpoints:\n  - {name: a, url: 'https://h:1', model: m}\n", "endpoints[0].url"),
        ("tenants:\n  - {name: a, max_band: vip}\n", "max_band"),
        ("admission:\n  fairness: lottery\n", "fairness"),
        ("routing:\n  block_bytes: 50\n", "block_bytes"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path, text, key):
    f = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_settings(f, {}, env={})
    msg = str(ei.value)
    assert "\n" not in msg
    assert key in msg, msg
    assert f in msg, "the message says which file"


def test_invalid_yaml_names_the_line(tmp_path):
    f = write(tmp_path, "port: 8000\nbands: [\n  {name: x\n")
    with pytest.raises(ConfigError) as ei:
        load_settings(f, {}, env={})
    msg = str(ei.value)
    assert "\n" not in msg and "invalid YAML" in msg and re.search(r"line \d+", msg)


def test_top_level_must_be_a_mapping_and_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(write(tmp_path, "- a\n- b\n"), {}, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(str(tmp_path / "missing.yaml"), {}, env={})
    assert load_settings(write(tmp_path, ""), {}, env={}).port == 8000


def test_bad_env_value_is_named(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_settings(None, {}, env={"VELOCITY_PORT": "many"})
    assert "port" in str(ei.value) and "VELOCITY_" in str(ei.value)


# -- the example in deploy/ -----------------------------------------------------------------------


def test_example_loads_and_validates():
    s = load_settings(str(EXAMPLE), {}, env={})
    assert s.policy == "dynamic" and s.port == 8000
    assert [e.name for e in s.endpoints] == ["e1", "e2"]
    assert [t.name for t in s.tenants] == ["alpha", "batch-jobs"]
    AdmissionSettings.from_settings(s)
    RoutingSettings.from_config(s.routing, s.models)


def _fields(struct) -> set[str]:
    return set(struct.__struct_fields__)


def test_example_shows_every_key():
    data = yaml.safe_load(EXAMPLE.read_text())
    assert set(data) == _fields(Settings)
    assert set(data["server"]) == _fields(ServerSettings)
    assert set(data["pd"]) == _fields(PdSettings)
    assert set(data["health"]) == _fields(HealthSettings)
    assert set(data["health"]["metrics"]) == _fields(MetricNames)
    assert all(set(t) == _fields(TenantConfig) for t in data["tenants"][:1])
    assert set(data["endpoints"][0]) == _fields(EndpointConfig)
    assert set(data["bands"][0]) == _fields(BandConfig)
    # admission: every key but those fed from the top level (bands, sla_ms, max_concurrency)
    assert set(data["admission"]) == _fields(AdmissionSettings) - {"bands", "sla_ms", "aimd_max"}
    # routing: every key but the per-model profiles, which come from `models:`
    assert set(data["routing"]) == _fields(RoutingSettings) - {"profiles"}


def test_example_values_are_the_defaults():
    data = yaml.safe_load(EXAMPLE.read_text())
    d = Settings()
    for key in (
        "policy",
        "host",
        "port",
        "admin_port",
        "sla_ms",
        "max_concurrency",
        "max_model_len",
        "api_key",
        "structured_logs",
        "log_level",
        "model_path",
    ):
        assert data[key] == getattr(d, key), key
    assert data["server"] == msgspec.to_builtins(ServerSettings())
    assert data["health"] == msgspec.to_builtins(HealthSettings())
    defaults = msgspec.to_builtins(RoutingSettings())
    assert {k: defaults[k] for k in data["routing"]} == data["routing"]


def test_example_admission_bands_and_sim_values_are_the_defaults():
    """The file claims to show each key's default: the admission section's, the bands' and
    each `sim:` key's (the sim-engine flag's own default, as `chargeVelocity` passes them)."""
    data = yaml.safe_load(EXAMPLE.read_text())
    adm = msgspec.to_builtins(AdmissionSettings())
    assert {k: adm[k] for k in data["admission"]} == data["admission"]
    assert data["bands"] == adm["bands"]
    p = argparse.ArgumentParser()
    add_sim_arguments(p)
    flags = vars(p.parse_args([]))
    assert {k: flags[k] for k in data["sim"]} == data["sim"]


def test_example_is_commented_throughout():
    # Every key sits under a comment: the nearest line above it that is not itself a key
    # or a list item is a comment (keys of one block may share theirs).
    lines = EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[a-z_]+:", line):
            continue
        j = i - 1
        while j >= 0 and re.match(r"^\s*([a-z_]+:|- )", lines[j]):
            j -= 1
        assert j >= 0 and lines[j].strip().startswith("#"), f"line {i + 1} ({line.strip()}) has no comment"


def test_example_sim_section_are_sim_engine_flags():
    s = load_settings(str(EXAMPLE), {}, env={})
    p = argparse.ArgumentParser(exit_on_error=False)
    add_sim_arguments(p)
    ns = p.parse_args(sim_flags(s, None))
    assert ns.max_num_seqs == s.sim["max_num_seqs"]
    assert ns.enable_prefix_caching is True
    assert ns.prefix_cache_blocks is None


def test_tenant_defaults():
    s = load_settings(None, {"tenants": [{"name": "t"}]}, env={})
    assert s.tenants == [TenantConfig(name="t")]
