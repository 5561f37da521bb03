"""Every project file that a comment, a docstring or a document names exists.

A comment that cites a file by the name it had before the code moved into its concept
package sends a reader to a file that is not there. This test reads the comments and docstrings
of the code (``.py``, ``.pyx``, ``.pxd``, ``.pyi``, ``csrc/*.h``) and the whole text of the
documents (``*.md``), takes each name that looks like a source or document file, and
finds it: a path (``routing/router.pyx``) relative to the repository, the package or the
file's own folder, or as the ending of a tracked path; a bare name (``router.pyx``) as the
name of some tracked file. Nothing outside the repository counts: a clone is all a reader
has (tests/test_no_outside_refs.py keeps such names out).

Names that are not this project's are listed in ``EXTERNAL`` with the reason.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A file name with an extension of the project's sources, documents or deploy files.
NAME = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)*[\w-]+\.(?:pyx|pxd|pyi|py|h|md))(?![\w/(])")

EXTERNAL_PREFIXES = (
    "vllm/",  # vLLM's own source tree, cited where its behaviour is copied
    "asyncio/",  # CPython's standard library
    "sys/",  # system C headers
)
EXTERNAL = {
    # C and CPython headers the compiled code includes.
    "Python.h",
    "stddef.h",
    "stdint.h",
    "stdlib.h",
    "string.h",
    "emmintrin.h",
    "immintrin.h",
    "malloc.h",
}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split("\n") if p and (ROOT / p).exists()]


def python_prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and string literal standing as a statement (docstrings)."""
    out: list[tuple[int, str]] = []
    prev = tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
            elif tok.type == tokenize.STRING and prev in (
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.NL,
            ):
                out.append((tok.start[0], tok.string))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return cython_prose(text)
    return out


_CY_PROSE = re.compile(r'"""(?:.|\n)*?"""|#[^\n]*')
_C_PROSE = re.compile(r"/\*(?:.|\n)*?\*/|//[^\n]*")


def cython_prose(text: str) -> list[tuple[int, str]]:
    """Comments and triple-quoted strings: Cython's own syntax is not Python's."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in _CY_PROSE.finditer(text)]


def c_prose(text: str) -> list[tuple[int, str]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in _C_PROSE.finditer(text)]


def prose(path: str, text: str) -> list[tuple[int, str]]:
    if path.endswith((".py", ".pyi")):
        return python_prose(text)
    if path.endswith((".pyx", ".pxd")):
        return cython_prose(text)
    if path.endswith(".h"):
        return c_prose(text)
    return [(1, text)]


def missing_names() -> list[str]:
    files = tracked()
    paths = set(files)
    names = {Path(p).name for p in files}
    folders = {str(parent) for p in files for parent in Path(p).parents}
    bad = []
    for path in files:
        if not path.endswith((".py", ".pyx", ".pxd", ".pyi", ".h", ".md")):
            continue
        text = (ROOT / path).read_text(errors="replace")
        for line, chunk in prose(path, text):
            for m in NAME.finditer(chunk):
                ref = m.group(1)
                if ref in EXTERNAL or ref.startswith(EXTERNAL_PREFIXES):
                    continue
                if "/" not in ref:
                    found = ref in names
                else:
                    bases = ("", "velocity_fast/", str(Path(path).parent) + "/")
                    found = any(str(Path(b + ref)) in paths or str(Path(b + ref)) in folders for b in bases) or any(
                        p.endswith("/" + ref) for p in paths
                    )
                if not found:
                    at = line + chunk.count("\n", 0, m.start())
                    bad.append(f"{path}:{at}: {ref}")
    return bad


def test_every_file_named_in_a_comment_docstring_or_document_exists():
    bad = missing_names()
    assert not bad, "names of files that do not exist:\n" + "\n".join(bad)


def test_the_check_sees_a_stale_name(tmp_path, monkeypatch):
    # The scanner itself: a comment naming a file that is gone is caught, one that exists is not.
    text = "# see routing/router.pyx and server.pyx\n"
    found = [m.group(1) for _, chunk in prose("x.py", text) for m in NAME.finditer(chunk)]
    assert found == ["routing/router.pyx", "server.pyx"]
    assert "server.pyx" not in {Path(p).name for p in tracked()}
    assert (ROOT / "velocity_fast/routing/router.pyx").exists()


if __name__ == "__main__":
    print("\n".join(missing_names()))
