"""`workers:` (and --workers, VELOCITY_WORKERS): an integer of at least 1, or `auto`; any
other value is a config error in the one form, `<source>: workers: <why>`."""

from __future__ import annotations

import pytest

from velocity_fast.config import ConfigError, load_settings


@pytest.mark.parametrize("text, shown", [("0", "0"), ("many", "'many'"), ("1.5", "1.5"), ("2000", "2000")])
def test_a_bad_workers_value_is_refused_naming_the_key(tmp_path, text, shown):
    f = tmp_path / "c.yaml"
    f.write_text(f"workers: {text}\n")
    with pytest.raises(ConfigError) as ei:
        load_settings(str(f), {}, env={})
    assert str(ei.value) == f"{f}: workers: must be an integer in [1, 1024] or auto, got {shown}"


def test_the_flag_and_the_environment_are_named_as_the_source():
    with pytest.raises(ConfigError, match=r"^--workers: workers: must be an integer in \[1, 1024\] or auto"):
        load_settings(None, {"workers": "0"}, env={})
    with pytest.raises(ConfigError, match=r"^VELOCITY_WORKERS: workers: must be "):
        load_settings(None, {}, env={"VELOCITY_WORKERS": "many"})


@pytest.mark.parametrize("given, want", [(None, 1), ("3", 3), ("auto", "auto")])
def test_good_values(given, want):
    flags = {} if given is None else {"workers": given}
    assert load_settings(None, flags, env={}).workers == want
