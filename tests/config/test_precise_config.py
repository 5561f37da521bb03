"""Config of precise prefix routing: prefix modes, tokenizers, endpoints' KV events."""

from __future__ import annotations

import argparse

import pytest

from velocity_fast.config import ConfigError, load_settings
from velocity_fast.gateway.assemble import routing_settings
from velocity_fast.gateway.flags import add_gateway_arguments, flag_overrides

EP = {"name": "e1", "url": "http://127.0.0.1:9", "model": "m"}
# An endpoint whose engine publishes its KV events (what a precise pool needs).
EP_EVENTS = "{name: e1, url: 'http://127.0.0.1:9', model: m, kv_events: {endpoint: 'tcp://127.0.0.1:5557'}}"


def write(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def flags(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_gateway_arguments(p)
    return flag_overrides(p.parse_args(list(argv)))


def test_default_is_approximate_everywhere():
    rs = routing_settings(load_settings(None, {"endpoints": []}, env={}))
    assert rs.prefix == "approximate" and rs.prefix_for("any") == "approximate"
    assert not rs.precise_models()


def test_prefix_and_tokenizer_flags_join_the_files_routing_section(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    cfg = write(tmp_path, f"routing: {{hotspot_gap: 3.0}}\nendpoints: [{EP_EVENTS}]\n")
    s = load_settings(cfg, flags("--prefix", "precise", "--tokenizer", str(tok)), env={})
    rs = routing_settings(s)
    assert (rs.prefix, rs.tokenizer, rs.hotspot_gap) == ("precise", str(tok), 3.0)
    assert rs.prefix_for("m") == "precise" and rs.tokenizer_for("m") == str(tok)


def test_per_model_prefix_and_tokenizer(tmp_path):
    tok = tmp_path / "t.json"
    tok.write_text("{}")
    cfg = write(tmp_path, f"models: {{m: {{prefix: precise, tokenizer: '{tok}'}}, n: {{prefix: 'off'}}}}\n")
    rs = routing_settings(load_settings(cfg, {}, env={}))
    assert rs.prefix_for("m") == "precise" and rs.prefix_for("n") == "off" and rs.prefix_for("o") == "approximate"
    assert rs.tokenizer_for("m") == str(tok) and rs.tokenizer_for("n") is None


@pytest.mark.parametrize(
    "text, key",
    [
        ("routing: {prefix: exact}\n", "prefix"),
        ("models: {m: {prefix: exact}}\n", "models.m.prefix"),
        (
            "routing: {prefix: precise}\nendpoints: [{name: e1, url: 'http://127.0.0.1:9', model: m}]\n",
            "routing.prefix",
        ),
        ("routing: {tokenizer: /no/such/tokenizer.json}\n", "routing.tokenizer"),
        (
            "endpoints: [{name: e1, url: 'http://127.0.0.1:9', model: m, kv_events: {endpoint: '127.0.0.1:5557'}}]\n",
            "endpoints[0].kv_events.endpoint",
        ),
        (
            "endpoints: [{name: e1, url: 'http://127.0.0.1:9', model: m, kv_events: {replay_endpoint: 'tcp://x:1'}}]\n",
            "endpoint",
        ),
    ],
)
def test_bad_precise_config_is_one_line_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, text), {}, env={})
    assert key in str(e.value) and "\n" not in str(e.value)


def test_the_default_profile_is_chat_under_every_policy_so_precise_acts_on_an_unlisted_model(tmp_path):
    tok = tmp_path / "t.json"
    tok.write_text("{}")
    for policy in ("static", "dynamic", "smart"):
        cfg = write(tmp_path, f"policy: {policy}\nendpoints: [{EP_EVENTS}]\n")
        rs = routing_settings(load_settings(cfg, flags("--prefix", "precise", "--tokenizer", str(tok)), env={}))
        assert rs.profile_for("m") == "chat" and rs.prefix_for("m") == "precise", policy


@pytest.mark.parametrize(
    "text, key, why",
    [
        # No endpoint of the precise model publishes its events: no index could ever be exact.
        (
            "routing: {prefix: precise, tokenizer: TOK}\nendpoints: [{name: e1, url: 'http://127.0.0.1:9', model: m}]\n",
            "routing.prefix",
            "none of its endpoints publishes KV events",
        ),
        (
            "models: {m: {prefix: precise, tokenizer: TOK}}\n"
            "endpoints: [{name: e1, url: 'http://127.0.0.1:9', model: m}, EVENTS_N]\n",
            "models.m.prefix",
            "none of its endpoints publishes KV events",
        ),
        # Precise is the chat profile's: a pool routed by another profile reads no prefix.
        (
            "routing: {prefix: precise, tokenizer: TOK, default_profile: batch}\nendpoints: [EVENTS]\n",
            "routing.prefix",
            "'batch' profile",
        ),
        (
            "models: {m: {prefix: precise, tokenizer: TOK, profile: round-robin}}\nendpoints: [EVENTS]\n",
            "models.m.prefix",
            "'round-robin' profile",
        ),
    ],
)
def test_a_precise_pool_that_could_make_no_precise_pick_is_refused_saying_why(tmp_path, text, key, why):
    tok = tmp_path / "t.json"
    tok.write_text("{}")
    text = (
        text.replace("TOK", f"'{tok}'")
        .replace("EVENTS_N", EP_EVENTS.replace("e1", "e2").replace("model: m", "model: n"))
        .replace("EVENTS", EP_EVENTS)
    )
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, text), {}, env={})
    assert key in str(e.value) and why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_same_precise_pool_with_an_endpoint_publishing_events_is_accepted(tmp_path):
    tok = tmp_path / "t.json"
    tok.write_text("{}")
    cfg = write(
        tmp_path,
        f"routing: {{prefix: precise, tokenizer: '{tok}'}}\nendpoints: [{EP_EVENTS}, "
        "{name: e2, url: 'http://127.0.0.1:10', model: m}]\n",
    )
    assert routing_settings(load_settings(cfg, {}, env={})).prefix_for("m") == "precise"


def test_endpoint_kv_events_are_read(tmp_path):
    cfg = write(
        tmp_path,
        "endpoints: [{name: e1, url: 'http://127.0.0.1:9', model: m, kv_events: "
        "{endpoint: 'tcp://127.0.0.1:5557', replay_endpoint: 'tcp://127.0.0.1:5558', topic: kv}}]\n",
    )
    kv = load_settings(cfg, {}, env={}).endpoints[0].kv_events
    assert (kv.endpoint, kv.replay_endpoint, kv.topic) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv")


def test_serve_with_a_tokenizer_that_is_not_one_exits_2_naming_the_key(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json")
    cfg = write(tmp_path, f"endpoints: [{EP_EVENTS}]\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "velocity_fast",
            "serve",
            "--config",
            cfg,
            "--prefix",
            "precise",
            "--tokenizer",
            str(bad),
            "--port",
            "0",
            "--admin-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "config error: --tokenizer: routing.tokenizer" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_precise_with_endpoints_given_by_flag_exits_2_saying_they_publish_no_events(tmp_path):
    """`serve --prefix precise --endpoint ...` cannot name an events address: refused, not
    silently approximate."""
    import subprocess
    import sys

    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "velocity_fast",
            "serve",
            "--endpoint",
            "e1=http://127.0.0.1:9=m",
            "--prefix",
            "precise",
            "--tokenizer",
            str(tok),
            "--port",
            "0",
            "--admin-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "model 'm' is precise but none of its endpoints publishes KV events" in proc.stderr
        and "Traceback" not in proc.stderr
    )
