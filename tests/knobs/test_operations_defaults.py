"""docs/operations.md, "Defaults, and why": every default the table gives is the code's.

A row names one key or several (`admission.sla_tolerance` / `_high`: the second shares the
first's section) and gives as many values, separated by " / ". A value is a word in
backticks, a number with an optional unit (`16 MiB`; `60 s` for a key in ms), or
"= `key`" for a default that is another key's value. Rows about the default bands
("bands ... ceilings", "band queue capacities", "band TTLs") are checked against the
default bands, highest first.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.config import ServerSettings, Settings
from velocity_fast.fleet.health import HealthSettings
from velocity_fast.routing.settings import RoutingSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SECTIONS = {
    "admission": AdmissionSettings,
    "routing": RoutingSettings,
    "health": HealthSettings,
    "server": ServerSettings,
}
BAND_ROWS = {"ceilings": "ceiling", "queue capacities": "queue_capacity", "TTLs": "ttl_ms"}
UNITS = {"MiB": 1024 * 1024, "KiB": 1024}


def _rows() -> list[tuple[str, str]]:
    text = DOC.read_text().split("## Defaults, and why\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith(("| setting", "|---")):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            assert len(cells) == 3, f"a row that does not parse: {line}"
            rows.append((cells[0], cells[1]))
    assert len(rows) > 15, "the defaults table was not found"
    return rows


def _default(key: str):
    section, _, name = key.rpartition(".")
    obj = SECTIONS[section]() if section else Settings()
    assert hasattr(obj, name), f"docs/operations.md names {key}, which is no setting"
    return getattr(obj, name)


def _keys(cell: str) -> list[str]:
    names = re.findall(r"`([^`]+)`", cell)
    out = []
    for n in names:
        if out and "." not in n:  # `_high`, `kv_threshold`: the first key's section
            section, _, first = out[0].rpartition(".")
            n = first + n if n.startswith("_") else n
            n = f"{section}.{n}" if section else n
        out.append(n)
    return out


def _value(part: str, key: str | None):
    part = part.strip()
    if m := re.fullmatch(r"`([^`]*)`", part):
        return m.group(1)
    m = re.match(r"(-?[\d.]+)\s*(MiB|KiB|s)?\b", part)
    assert m, f"{key}: cannot read the default {part!r}"
    v = float(m.group(1))
    if m.group(2) in UNITS:
        v *= UNITS[m.group(2)]
    elif m.group(2) == "s" and key is not None and key.endswith("_ms"):
        v *= 1000
    return v


def _same(doc, real) -> bool:
    if isinstance(real, bool) or isinstance(doc, str):
        return str(doc) == str(real)
    return real is not None and float(doc) == float(real)


@pytest.mark.parametrize("setting, default", _rows(), ids=[r[0] for r in _rows()])
def test_the_defaults_table_gives_the_codes_defaults(setting, default):
    parts = default.split(" / ")
    band = next((f for words, f in BAND_ROWS.items() if setting.startswith("band") and words in setting), None)
    if (m := re.fullmatch(r"`bands\[\]\.(\w+)`", setting)) is not None:
        band = m.group(1)  # one value a default band, highest first; "none": left to another key
    if band is not None:
        want = [getattr(b, band) for b in AdmissionSettings().bands]
        got = [None if p.strip() == "none" else _value(p, band) for p in parts]
        assert got == want, f"{setting}: the doc says {got}, the default bands {want}"
        return
    keys = _keys(setting)
    assert keys and len(keys) == len(parts), f"{setting}: {len(keys)} keys, {len(parts)} values ({default})"
    for key, part in zip(keys, parts):
        if (m := re.fullmatch(r"= `([^`]+)`", part.strip())) is not None:
            assert _default(key) is None, f"{key}: the doc says it is {m.group(1)}'s, the code {_default(key)!r}"
            continue
        doc = _value(part, key)
        assert _same(doc, _default(key)), f"{key}: the doc says {part.strip()!r}, the code {_default(key)!r}"
