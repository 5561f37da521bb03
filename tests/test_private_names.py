"""A name with a leading underscore is its module's own (docs/design.md, "Names").

No module of ``velocity_fast`` or ``bench`` imports another's underscore name, nor reads,
calls or assigns ``obj._name`` where ``_name`` is defined in some other module and not
in its own. A module is a ``.py``, or a ``.pyx`` with its ``.pxd``. Defined means: a
``def``/``cdef``/``cpdef`` function or method, a ``cdef`` attribute or enum member, a
module-level or class-level name, or an attribute set as ``self._name =``. What another
module needs has a public name; a ``cdef`` method ``_x`` used by its own module beside a
Python face ``x`` (uvloop's ``_write`` and ``write``) is fine. Underscore names defined
nowhere here (``sys._getframe``, ``os._exit``) are not this project's and not checked; a
subclass that overrides ``_x`` defines it in its own module.

Run this file as a script to print what it finds:

    .venv/bin/python tests/test_private_names.py
"""

from __future__ import annotations

import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("velocity_fast", "bench")
SUFFIXES = (".py", ".pyx", ".pxd")

_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)")
_CFUNC = re.compile(r"^[ \t]*c?p?def[ \t]+[^=(]*?\b(\w+)[ \t]*\(")
_CLASS = re.compile(r"^[ \t]*(?:c?p?def[ \t]+(?:(?:public|api|final)[ \t]+)*)?class[ \t]+(\w+)")
_CDECL = re.compile(r"^[ \t]*cdef[ \t]+(?!class\b|extern\b|enum\b|struct\b|union\b|inline\b)(.*)$")
_ASSIGN = re.compile(r"^[ \t]*(\w+)[ \t]*(?::[^=]*)?(?:=(?!=)|$)")
_SELF_SET = re.compile(r"\b(?:self|cls)\.(_\w+)[ \t]*(?:[-+*/|&]?=(?!=)|:[^=\n]*=(?!=)|,)")
_FROM = re.compile(
    r"^[ \t]*from[ \t]+(\.+[\w.]*|(?:velocity_fast|bench)(?:\.[\w.]+)?)[ \t]+c?import[ \t]+"
    r"(\([^)]*\)|(?:[^\n\\]|\\\n)*)",
    re.M,
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _module_key(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def source_files(root: Path = None) -> list[Path]:
    root = root or ROOT
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            if path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                out.append(path)
    return out


def _code_lines(text: str) -> list[str]:
    """The lines with comments and the insides of strings blanked (line numbers kept)."""
    lines = text.split("\n")
    out = [list(line) for line in lines]
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in (tokenize.STRING, tokenize.COMMENT) and tok.type != getattr(
                tokenize, "FSTRING_MIDDLE", -1
            ):
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            keep_quotes = tok.type != tokenize.COMMENT
            for r in range(r0, r1 + 1):
                row = out[r - 1]
                a = c0 if r == r0 else 0
                b = c1 if r == r1 else len(row)
                for c in range(a, b):
                    if not (keep_quotes and row[c] in "'\"") and row[c] != "\n":
                        row[c] = " "
    except (tokenize.TokenError, IndentationError, SyntaxError):
        # Cython the tokenizer cannot follow: fall back to dropping '#' comments.
        return [re.sub(r"#.*", "", line) for line in lines]
    return ["".join(row) for row in out]


def definitions(path: Path, lines: list[str]) -> set[str]:
    """The underscore names the file defines (functions, methods, attributes, module names)."""
    found: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, kind) of the open blocks
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        kind = stack[-1][1] if stack else "module"
        for m in _SELF_SET.finditer(line):
            found.add(m.group(1))
        if m := _CLASS.match(line):
            found.add(m.group(1))
            stack.append((indent, "class"))
            continue
        if m := _DEF.match(line) or (line.lstrip().startswith(("cdef", "cpdef")) and _CFUNC.match(line)):
            found.add(m.group(1))
            stack.append((indent, "def"))
            continue
        if re.match(r"[ \t]*(?:cdef|cpdef|ctypedef)[ \t]+(?:\w+[ \t]+)?(?:enum|struct|union)\b", line):
            m = re.search(r"\b(?:enum|struct|union)[ \t]+(\w+)", line)
            if m:
                found.add(m.group(1))
            stack.append((indent, "enum"))
            continue
        if re.match(r"[ \t]*cdef[ \t]+extern\b", line):
            stack.append((indent, "extern"))
            continue
        if kind in ("module", "class", "enum"):
            if m := _CDECL.match(line):
                decl = m.group(1).split("=")[0]
                found.update(n for n in re.findall(r"\b\w+\b", decl) if _private(n))
            elif kind == "enum":
                if m := re.match(r"[ \t]*(\w+)", line):
                    found.add(m.group(1))
            elif m := _ASSIGN.match(line):
                found.add(m.group(1))
    return {n for n in found if _private(n)}


def _resolve(importer: Path, mod: str) -> str | None:
    """The module key a ``from mod import`` names, or None if it is not one of ours."""
    if mod.startswith("."):
        dots = len(mod) - len(mod.lstrip("."))
        base = list(importer.relative_to(ROOT).with_suffix("").parts[:-1])
        base = base[: len(base) - (dots - 1)] if dots > 1 else base
        parts = base + [p for p in mod.lstrip(".").split(".") if p]
    else:
        parts = mod.split(".")
    return ".".join(parts) if parts and parts[0] in PACKAGES else None


def violations(root: Path = None) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, (root or ROOT)
    try:
        files = source_files()
        code = {p: _code_lines(p.read_text()) for p in files}
        defined: dict[str, set[str]] = defaultdict(set)  # module key -> names
        for p, lines in code.items():
            defined[_module_key(p)] |= definitions(p, lines)
        where: dict[str, set[str]] = defaultdict(set)  # name -> modules that define it
        for key, names in defined.items():
            for n in names:
                where[n].add(key)
        bad = []
        for p, lines in code.items():
            key = _module_key(p)
            text = "\n".join(lines)
            rel = p.relative_to(ROOT)
            for m in _FROM.finditer(text):
                target = _resolve(p, m.group(1))
                if target is None or target == key:
                    continue
                names = re.findall(r"(?:^|[(,\s])(\w+)(?:\s+as\s+\w+)?", m.group(2).strip("()\\"))
                for n in names:
                    if _private(n):
                        line = text.count("\n", 0, m.start()) + 1
                        bad.append(f"{rel}:{line}: imports {n} from {target}")
            own = defined[key]
            for i, line in enumerate(lines, 1):
                # Each name before a dot, the attribute read by lookahead: a chain such as
                # self._a._b yields both (self, _a) and (_a, _b).
                for m in re.finditer(r"(\w+|[)\]])(?=[ \t]*\.[ \t]*(_\w+))", line):
                    obj, name = m.group(1), m.group(2)
                    if obj in ("self", "cls") or not _private(name) or name in own or name not in where:
                        continue
                    others = ", ".join(sorted(where[name]))
                    bad.append(f"{rel}:{i}: {obj}.{name} ({name} is defined in {others})")
        return bad
    finally:
        ROOT = saved


def test_no_module_uses_another_modules_underscore_names():
    bad = violations()
    assert not bad, "underscore names used outside their module:\n" + "\n".join(bad)


def test_the_scan_sees_both_kinds_of_use(tmp_path):
    """The check is not vacuous: an imported underscore name and a foreign attribute are caught."""
    pkg = tmp_path / "velocity_fast" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (pkg / "x.pxd").write_text("cdef class X:\n    cdef int _n\n    cdef void _go(self)\n")
    (pkg / "x.pyx").write_text(
        "cdef class X:\n    cdef void _go(self):\n        self._n += 1\ndef _helper():\n    pass\n"
    )
    (pkg / "y.pyx").write_text(
        "from velocity_fast.a.x cimport X\nfrom .x import (\n    X,\n    _helper,\n)\n"
        "cdef f(X x):\n    x._go()  # x._n in a comment is not a use\n"
        "    self._x._go()\n"
        "    s = 'x._n'\n    return sys._getframe()\n"
    )
    (pkg / "z.py").write_text("class Z:\n    def _go(self):\n        return self._go\ndef g(z):\n    return z._go()\n")
    found = violations(tmp_path)
    assert len(found) == 3, found
    assert found[0].startswith("velocity_fast/a/y.pyx:2: imports _helper")
    assert found[1].startswith("velocity_fast/a/y.pyx:7: x._go")
    assert found[2].startswith("velocity_fast/a/y.pyx:8: _x._go")


if __name__ == "__main__":
    bad = violations()
    for b in bad:
        print(b)
    print(f"{len(bad)} use(s) of another module's underscore names")
