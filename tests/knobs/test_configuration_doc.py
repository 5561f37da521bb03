"""docs/configuration.md against the settings Structs: every field has a row, every row a
field, a default written as a value is the Struct's default, the reload column agrees
with the keys the reload reports as needing a restart, and every numeric key's range in
"Ranges" is the range its Struct declares (and enforces)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import yaml

from velocity_fast.admission.settings import AdmissionSettings, BandSettings
from velocity_fast.config import (
    ConfigError,
    EndpointConfig,
    ModelConfig,
    PdSettings,
    ServerSettings,
    Settings,
    TenantConfig,
    TracingSettings,
    key_range,
    load_settings,
)
from velocity_fast.fleet.health import HealthSettings
from velocity_fast.fleet.scrape import MetricNames
from velocity_fast.gateway.reload import RESTART_KEYS
from velocity_fast.routing.settings import RoutingSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Where each Struct's fields live in the file.
SECTIONS = [
    ("", Settings),
    ("endpoints[].", EndpointConfig),
    ("models.<name>.", ModelConfig),
    ("bands[].", BandSettings),
    ("tenants[].", TenantConfig),
    ("admission.", AdmissionSettings),
    ("routing.", RoutingSettings),
    ("health.", HealthSettings),
    ("health.metrics.", MetricNames),
    ("server.", ServerSettings),
    ("pd.", PdSettings),
    ("tracing.", TracingSettings),
]

# Defaults that come from elsewhere, said in words in the table.
DERIVED = {
    "bands": "the three default bands",
    "admission.bands": "the top-level bands",
    "admission.sla_ms": "the top-level sla_ms",
    "admission.aimd_max": "the top-level max_concurrency",
    "routing.saturation_waiting": "admission.queue_threshold",
    "routing.saturation_kv": "admission.kv_threshold",
    "routing.profiles": "the models: section",
    "routing.prefix_modes": "the models: section",
    "routing.tokenizers": "the models: section",
}

_ROW = re.compile(r"^\| `([^`]+)` \| (.+?) \| (yes|no) \| (.+) \|$")


def _keys_text() -> str:
    return DOC.read_text().split("\n## Ranges\n", 1)[0]


def _ranges() -> dict[str, str]:
    _, _, text = DOC.read_text().partition("\n## Ranges\n")
    assert text, "docs/configuration.md has no Ranges section"
    text = text.split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            m = re.fullmatch(r"\| `([^`]+)` \| (.+?) \|", line)
            assert m, f"a row of Ranges that does not parse: {line}"
            assert m.group(1) not in out, f"{m.group(1)} has two ranges"
            out[m.group(1)] = m.group(2)
    return out


def _rows() -> dict[str, tuple[str, str, str]]:
    rows: dict[str, tuple[str, str, str]] = {}
    for line in _keys_text().splitlines():
        if not line.startswith("| `"):
            continue
        m = _ROW.match(line)
        assert m, f"a table row of docs/configuration.md that does not parse: {line}"
        key, default, reload, what = m.groups()
        assert key not in rows, f"{key} has two rows"
        assert what.strip(), f"{key}: says nothing of what it does"
        rows[key] = (default.strip(), reload, what)
    return rows


def _fields() -> dict[str, msgspec.structs.FieldInfo]:
    out = {}
    for prefix, cls in SECTIONS:
        for f in msgspec.structs.fields(cls):
            out[prefix + f.name] = f
    return out


def _default(f: msgspec.structs.FieldInfo):
    if f.default is not msgspec.NODEFAULT:
        return f.default
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return msgspec.NODEFAULT


def test_every_field_has_a_row_and_every_row_a_field():
    rows, fields = _rows(), _fields()
    assert sorted(set(fields) - set(rows)) == [], "fields without a row in docs/configuration.md"
    assert sorted(set(rows) - set(fields)) == [], "rows of docs/configuration.md that are no field"


@pytest.mark.parametrize("key", sorted(_fields()))
def test_the_default_column_is_the_structs_default(key):
    default_cell = _rows()[key][0]
    f = _fields()[key]
    value = _default(f)
    if value is msgspec.NODEFAULT:
        assert default_cell == "required", f"{key} has no default: say `required`"
        return
    if isinstance(value, msgspec.Struct):
        assert default_cell == "the values below", f"{key}: a section, its defaults in its own rows"
        return
    if key in DERIVED:
        return  # said in words: where it comes from
    m = re.fullmatch(r"`([^`]*)`", default_cell)
    assert m, f"{key}: write the default as a value in backticks, not {default_cell!r}"
    assert yaml.safe_load(m.group(1)) == msgspec.to_builtins(value), (
        f"{key}: the table says {m.group(1)}, the Struct {value!r}"
    )


def test_the_reload_column_follows_the_restart_keys():
    for key, (_, reload, _) in _rows().items():
        top = re.split(r"[.\[]", key, maxsplit=1)[0]
        assert (reload == "no") == (top in RESTART_KEYS), (
            f"{key}: reload {reload!r}, but {top!r} is{'' if top in RESTART_KEYS else ' not'} a restart key"
        )


def test_every_restart_key_is_a_top_level_key():
    assert set(RESTART_KEYS) <= set(Settings.__struct_fields__)


def test_the_example_config_sets_only_documented_keys():
    example = yaml.safe_load((DOC.parents[1] / "deploy" / "config.example.yaml").read_text())
    rows = _rows()

    def walk(prefix: str, obj) -> None:
        for k, v in obj.items():
            key = prefix + k
            if key.startswith("sim."):
                continue  # the sim engine's own flags
            assert key in rows, f"deploy/config.example.yaml sets {key}, not in docs/configuration.md"
            if isinstance(v, dict) and key not in ("sim",):
                walk(key + ".", v)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    walk(key + "[].", item)

    for k, v in example.items():
        if k == "models":
            for entry in v.values():
                walk("models.<name>.", entry)
            assert "models" in rows
        else:
            walk("", {k: v})


def _numeric_keys() -> dict[str, str]:
    out = {}
    for key in _fields():
        rng = key_range(key.replace("[]", "[0]").replace("<name>", "x"))
        if rng is not None:
            out[key] = rng
    return out


def test_every_numeric_key_has_its_range_in_the_doc():
    numeric, documented = _numeric_keys(), _ranges()
    assert len(numeric) > 50
    assert sorted(set(numeric) - set(documented)) == [], "numeric keys without a range in Ranges"
    assert sorted(set(documented) - set(numeric)) == [], "Ranges rows that are no numeric key"
    for key, rng in numeric.items():
        assert documented[key] == rng, f"{key}: the doc says {documented[key]}, the Struct {rng}"


def _below_and_above(rng: str) -> list[float]:
    """Values just outside a range written as an interval."""
    m = re.match(r"(integer|number) in ([\[(])(-?[\d.e+]+), (-?[\d.e+]+)([\])])", rng)
    assert m, rng
    kind, lo_b, lo, hi, hi_b = m.groups()
    step = 1 if kind == "integer" else 0.5
    lo_v, hi_v = float(lo), float(hi)
    out = [lo_v if lo_b == "(" else lo_v - step, hi_v if hi_b == ")" else hi_v + step]
    return [int(v) if kind == "integer" else v for v in out]


@pytest.mark.parametrize(
    "key", sorted(k for k, r in _numeric_keys().items() if r.startswith(("integer in", "number in")))
)
def test_a_value_just_outside_the_range_is_refused_naming_the_key(key, tmp_path):
    """The documented range is the one enforced: a value past either end is a config error
    that names the full key."""
    for value in _below_and_above(_ranges()[key]):
        data: dict = {}
        parts = key.split(".")
        if key.startswith(("bands[]", "tenants[]")):
            top, field = key.split("[].")
            item = {"name": "x", "ceiling": 1.0} if top == "bands" else {"name": "x"}
            data[top] = [{**item, field: value}]
            shown = f"{top}[0].{field}"
        else:
            node = data
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
            shown = key
        f = tmp_path / "c.yaml"
        f.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError) as ei:
            load_settings(str(f), {}, env={})
        assert str(ei.value).startswith(f"{f}: {shown}: must be "), (value, str(ei.value))
