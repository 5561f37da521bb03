"""Endpoint roles (prefill, decode, both) and the pd section, validated at start and reload."""

from __future__ import annotations

import pytest

from velocity_fast.config import ConfigError, load_settings


def _load(endpoints, **keys):
    return load_settings(None, {"endpoints": endpoints, **keys}, env={})


def _ep(name, role=None, model="m"):
    d = {"name": name, "url": f"http://127.0.0.1:1/{name}", "model": model}
    if role is not None:
        d["role"] = role
    return d


def test_role_defaults_to_both_and_pd_to_its_measured_threshold():
    s = _load([_ep("a")])
    assert s.endpoints[0].role == "both"
    assert s.pd.min_uncached_tokens == 256
    assert s.pd.prefill_timeout_s == 60.0


def test_a_pool_of_prefill_and_decode_endpoints_is_accepted():
    s = _load([_ep("p", "prefill"), _ep("d", "decode"), _ep("x", "both", model="other")])
    assert [e.role for e in s.endpoints] == ["prefill", "decode", "both"]


def test_prefill_endpoints_without_a_decoding_one_are_refused_saying_why():
    with pytest.raises(
        ConfigError, match=r"endpoints\[1\]\.role: model 'm' has prefill endpoints but none that decodes"
    ):
        _load([_ep("x", model="other"), _ep("p", "prefill"), _ep("p2", "prefill")])


def test_decode_endpoints_without_a_prefilling_one_are_refused_saying_why():
    with pytest.raises(
        ConfigError, match=r"endpoints\[0\]\.role: model 'm' has decode endpoints but none that prefills"
    ):
        _load([_ep("d", "decode")])


def test_a_both_endpoint_serves_either_side():
    _load([_ep("p", "prefill"), _ep("b", "both")])
    _load([_ep("d", "decode"), _ep("b", "both")])


def test_an_unknown_role_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="role"):
        _load([_ep("p", "prefiller")])


def test_pd_bounds_are_checked():
    with pytest.raises(ConfigError, match="min_uncached_tokens"):
        _load([_ep("a")], pd={"min_uncached_tokens": -1})
    with pytest.raises(ConfigError, match="prefill_timeout_s"):
        _load([_ep("a")], pd={"prefill_timeout_s": 0})
    with pytest.raises(ConfigError, match="max_prefill_tokens_in_flight"):
        _load([_ep("a")], pd={"max_prefill_tokens_in_flight": -1})
