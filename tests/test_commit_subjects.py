"""The history's habit: a commit subject of at most 72 characters (the why goes in the
body), for every commit since the tree was first formatted by ruff. Skips where the
checkout has no history to read (an exported tree)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SINCE = "c441943"  # style: ruff format over the tree
MAX = 72


def _log(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30).stdout


def test_commit_subjects_fit_72_characters():
    if not _log("rev-parse", "--verify", "--quiet", SINCE + "^{commit}").strip():
        pytest.skip(f"no history back to {SINCE} in this checkout")
    long = [s for s in _log("log", "--format=%h %s", f"{SINCE}..HEAD").splitlines() if len(s.split(" ", 1)[1]) > MAX]
    assert not long, f"subjects over {MAX} characters (the why goes in the body): {long}"
