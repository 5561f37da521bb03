"""Imports point down only (docs/design.md, "Layers").

Every ``import``, ``from ... import`` and ``cimport`` line of the package's .py, .pyx and
.pxd files, at module level or inside a function, is read; each names the package it
comes from. A package may use its own modules and those of the layers below it, never
one of its own layer or above. Run this file as a script to print the graph:

    .venv/bin/python tests/test_layers.py
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "velocity_fast"

# Bottom first. A package may import from any strictly lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "lowlevel", "harness"),  # the version; cimport-only helpers; child processes
    ("io", "http", "metrics"),  # sockets; HTTP messages; metric values and registry
    ("server", "upstream", "state"),  # the client connection; engine connections; where a count lives
    ("fleet", "kvevents"),  # endpoints, pools, health, scrapes; the engines' KV events
    ("admission", "routing"),  # whether and when; where
    ("config",),  # the settings file, built from the sections above
    ("engines", "sim"),  # engines the gateway starts; the simulated engine
    ("gateway",),  # the app: ingress, exchange, requests, reload, launch
    ("loadgen",),  # the load generator (talks to the gateway over sockets)
    ("cli",),
    ("__main__",),  # python -m velocity_fast
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?P<from>\.+[\w.]*|velocity_fast(?:\.[\w.]+)?)[ \t]+c?import\b"
    r"|c?import[ \t]+(?P<mod>velocity_fast(?:\.[\w.]+)?))",
    re.M,
)


def _package(parts: tuple[str, ...]) -> str:
    return parts[0] if parts else "__init__"


def edges() -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> the lines that make the edge (file:line)."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PKG.rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxd") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(PKG).with_suffix("").parts
        src = _package(rel if len(rel) > 1 else (rel[0],))
        text = path.read_text()
        for m in _IMPORT.finditer(text):
            mod = m.group("from") or m.group("mod")
            if mod.startswith("."):
                dots = len(mod) - len(mod.lstrip("."))
                base = list(rel[:-1])[: len(rel) - dots]
                target = base + [p for p in mod.lstrip(".").split(".") if p]
            else:
                target = mod.split(".")[1:]
            dst = _package(tuple(target))
            if dst != src:
                line = text.count("\n", 0, m.start()) + 1
                out[(src, dst)].append(f"{path.relative_to(PKG.parent)}:{line}")
    return out


def violations() -> list[str]:
    bad = []
    for (src, dst), where in sorted(edges().items()):
        if src not in LAYER or dst not in LAYER:
            bad.append(f"{src} -> {dst}: a package missing from LAYERS ({where[0]})")
        elif LAYER[dst] >= LAYER[src]:
            bad.append(f"{src} (layer {LAYER[src]}) -> {dst} (layer {LAYER[dst]}): {', '.join(where)}")
    return bad


def test_every_package_has_a_layer():
    present = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.stem for p in PKG.glob("*.py")}
    assert present <= set(LAYER), f"packages without a layer: {sorted(present - set(LAYER))}"


def test_imports_point_down_only():
    assert violations() == []


def test_the_walker_sees_cimports_and_imports_inside_functions(tmp_path):
    """The check would catch an upward cimport and a function-level import (it is not vacuous)."""
    pkg = tmp_path / "velocity_fast"
    (pkg / "http").mkdir(parents=True)
    (pkg / "gateway").mkdir()
    (pkg / "http" / "message.pxd").write_text("from velocity_fast.gateway.exchange cimport Exchange\n")
    (pkg / "http" / "errors.py").write_text("def f():\n    from ..gateway import app\n")
    (pkg / "gateway" / "app.py").write_text("from velocity_fast.http.errors import error_body\n")
    globals()["PKG"] = pkg
    try:
        found = violations()
    finally:
        globals()["PKG"] = PKG_REAL
    assert len(found) == 1 and found[0].startswith("http (layer 1) -> gateway (layer 7)")
    assert "message.pxd:1" in found[0] and "errors.py:2" in found[0]


PKG_REAL = PKG


if __name__ == "__main__":
    for (src, dst), where in sorted(edges().items(), key=lambda kv: (LAYER.get(kv[0][0], 99), kv[0])):
        print(
            f"{src:>10} (layer {LAYER.get(src, '?')}) -> {dst:<10} (layer {LAYER.get(dst, '?')})  {len(where)} line(s)"
        )
    bad = violations()
    print(f"{len(bad)} upward or sideways import(s)")
    for b in bad:
        print("  " + b)
