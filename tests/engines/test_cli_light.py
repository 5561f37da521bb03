"""`velocityllm version` and `--help` answer like a binary: they load neither the event
loop (uvloop), nor msgspec, nor vLLM. Checked through sys.modules in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("uvloop", "msgspec", "vllm", "httptools", "orjson")

_PROBE = """
import json, sys
from velocity_fast.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("\\n@@" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _run(*argv: str) -> tuple[str, dict]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    text, _, probe = out.stdout.rpartition("\n@@")
    return text, json.loads(probe)


@pytest.mark.parametrize(
    "argv", [("version",), ("--version",), ("--help",), ("serve", "--help"), ("chargeVelocity", "--help")]
)
def test_light_commands_import_nothing_heavy(argv):
    text, probe = _run(*argv)
    assert probe["code"] in (0, None)
    loaded = [m for m in HEAVY if m in probe["modules"] or any(x.startswith(m + ".") for x in probe["modules"])]
    assert loaded == [], f"velocityllm {' '.join(argv)} imported {loaded}"
    assert text.strip(), "printed nothing"


def test_version_prints_the_package_version():
    from velocity_fast import __version__

    text, _ = _run("version")
    assert text.strip() == f"velocityllm {__version__}"


def test_help_lists_every_command():
    from velocity_fast.cli import COMMANDS

    text, _ = _run("--help")
    for cmd in COMMANDS:
        assert cmd in text
