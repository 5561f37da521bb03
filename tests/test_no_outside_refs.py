"""Code and docs say the thing itself: no issue numbers, no paths outside the repository.

A reader has the clone and nothing else. A comment that gives an issue's number instead of
the reason, or points at a design file kept beside the checkout, sends that reader nowhere:
the tracker and the folder are not in the clone. This test reads every tracked text file
of the package, the benchmarks, the tests, the docs, deploy/, csrc/, .ci/ and the top-level
files, and fails on a line that cites an issue (by its number or title, a tracker's
hash-number, a numbered finding of one) or names a path outside the repository (the
product documents beside the checkout, a machine's own folders). Say the reason, or name
the section of a document in the repository that holds it; ``RULES`` has the patterns.

Run this file as a script to print what it finds:

    .venv/bin/python tests/test_no_outside_refs.py
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("velocity_fast/", "bench/", "tests/", "docs/", "deploy/", "csrc/", ".ci/", "requirements/")
TOP = {"README.md", "Makefile", "setup.py", "pyproject.toml"}

# (what, pattern). The patterns are written so that their own text does not match them.
RULES = [
    ("an issue by number", re.compile(r"\bissues?\s*#?\s*\d+", re.I)),
    ("an issue in brackets", re.compile(r"\(\s*issues?\b", re.I)),
    ("an issue by title", re.compile(r"\bissues?\s*:", re.I)),
    ("a tracker number", re.compile(r"(?<![\w&#/'\"=])#\d+\b")),
    ("an issue's finding", re.compile(r"\bfindings?\s+#?\d+", re.I)),
    ("a machine's own folder", re.compile(r"/wor[k]/")),
    ("the folder beside the checkout", re.compile(r"\.\./share[d]\b|\bshared/(?:DESIGN|STYLE|VLLM)")),
    ("a product document outside the repository", re.compile(r"\b(?:DESIGN|STYLE|VLLM_CONTRACT)\.md\b")),
]


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split("\n") if p and (p.startswith(FOLDERS) or p in TOP)]


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the match) for each line of ``text`` that breaks a rule."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        for what, pattern in RULES:
            m = pattern.search(line)
            if m:
                out.append((n, what, m.group(0)))
    return out


def offending(root: Path, paths: list[str]) -> list[str]:
    bad = []
    for path in paths:
        try:
            text = (root / path).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # a binary file, or one deleted in the working tree
        bad += [f"{path}:{n}: {what}: {hit!r}" for n, what, hit in offending_lines(text)]
    return bad


def test_no_issue_number_or_outside_path_in_code_or_docs():
    bad = offending(ROOT, tracked())
    assert not bad, "say the reason or the in-repo doc section instead:\n" + "\n".join(bad)


def test_the_check_sees_each_kind_and_passes_plain_prose():
    # Built by concatenation, so that this file itself holds none of them.
    caught = [
        "see iss" + "ue 20",
        "(iss" + "ue: admission)",
        "Issue" + " 37's goal",
        "fixed in " + "#49",
        "finding" + " 3 of the read",
        "/wor" + "k/main/x.py",
        "../" + "shared/notes",
        "shared/" + "DESIGN" + ".md",
        "VLLM_" + "CONTRACT" + ".md",
        "STYLE" + ".md",
    ]
    for text in caught:
        assert offending_lines(text), text
    plain = [
        "docs/design.md, \"Where state lives\"",
        "fleet/shared.pyx",
        "the issues a reload raises",
        "issue the request again",
        "#include <stdint.h>",
        "a 256-slot table",
        "x-velocity-priority",
    ]
    for text in plain:
        assert not offending_lines(text), text


if __name__ == "__main__":
    print("\n".join(offending(ROOT, tracked())))
