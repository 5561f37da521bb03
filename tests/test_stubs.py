"""The .pyi stub beside each compiled module names exactly what that module defines.

Stubs are what editors and type checkers see of the compiled core; one left behind by a
move (a class renamed, merged or moved to another module) sends readers to names that no
longer exist. For every ``velocity_fast/**/*.pyx``:

- the ``.pyi`` beside it exists;
- its public top-level names (classes, functions, annotated or assigned names) are the
  public names the ``.pyx`` defines at top level: ``class``/``cdef class``, ``def``/``async
  def``/``cpdef`` functions and ``NAME = ...`` assignments (``cdef`` functions and
  variables are invisible to Python and do not count, nor do names starting with ``_``);
- that set agrees with the imported module (each name is there, and every public object
  whose ``__module__`` is the module is in it), so the source scan cannot drift silently;
- ``__all__``, where the module has one, is covered by the stub (defined or re-exported
  as ``from x import NAME as NAME``);
- every member a stub class declares exists on the compiled class, and every public method
  the compiled class introduces (not an override of a base's) is declared in the stub.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "velocity_fast"
PYX_FILES = sorted(PACKAGE.rglob("*.pyx"))

_DOCSTRING = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'')
_TOP_LEVEL = [
    re.compile(r"^(?:cdef\s+)?class\s+(\w+)", re.MULTILINE),  # class / cdef class
    re.compile(r"^(?:async\s+)?def\s+(\w+)", re.MULTILINE),  # def / async def
    re.compile(r"^cpdef\s+(?:\S+\s+)*?(\w+)\s*\(", re.MULTILINE),  # cpdef [return type] name(
    re.compile(r"^(\w+)\s*(?::[^=\n]*)?=(?!=)", re.MULTILINE),  # NAME = ... / NAME: T = ...
]


def module_name(pyx: Path) -> str:
    return ".".join(pyx.relative_to(PACKAGE.parent).with_suffix("").parts)


def pyx_public_names(pyx: Path) -> set[str]:
    """Public names the .pyx defines at top level (docstrings blanked so prose cannot match)."""
    src = _DOCSTRING.sub(lambda m: "\n" * m.group(0).count("\n"), pyx.read_text())
    names: set[str] = set()
    for pattern in _TOP_LEVEL:
        names.update(pattern.findall(src))
    return {n for n in names if not n.startswith("_")}


def stub_names(tree: ast.Module) -> tuple[set[str], set[str], dict[str, ast.ClassDef]]:
    """(public names the stub defines, names it re-exports, its classes by name)."""
    defined: set[str] = set()
    reexported: set[str] = set()
    classes: dict[str, ast.ClassDef] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defined.add(node.name)
            classes[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            reexported.update(a.asname for a in node.names if a.asname is not None and a.asname == a.name)
    return {n for n in defined if not n.startswith("_")}, reexported, classes


def class_members(node: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(methods and properties, annotated or assigned attributes) a stub class declares."""
    methods: set[str] = set()
    attrs: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return methods, attrs


def compiled_public_methods(cls: type) -> set[str]:
    """Public methods the compiled class introduces (not inherited or overridden, not descriptors)."""
    out = set()
    for name, value in vars(cls).items():
        if name.startswith("_") or any(hasattr(base, name) for base in cls.__mro__[1:]):
            continue
        if isinstance(value, (staticmethod, classmethod)) or inspect.isroutine(value):
            out.add(name)
    return out


def test_every_compiled_module_is_covered():
    assert len(PYX_FILES) >= 20, f"expected the compiled core under {PACKAGE}, found {len(PYX_FILES)} .pyx"


@pytest.mark.parametrize("pyx", PYX_FILES, ids=module_name)
def test_stub_matches_compiled_module(pyx: Path):
    modname = module_name(pyx)
    stub = pyx.with_suffix(".pyi")
    assert stub.exists(), f"{modname}: no stub {stub.relative_to(PACKAGE.parent)} beside {pyx.name}"

    module = importlib.import_module(modname)
    source = pyx_public_names(pyx)
    problems: list[str] = []

    # The source scan agrees with the module as imported.
    absent = sorted(n for n in source if not hasattr(module, n))
    if absent:
        problems.append(f"the .pyx scan finds names the imported module lacks: {absent}")
    own = {
        n for n in dir(module) if not n.startswith("_") and getattr(getattr(module, n), "__module__", None) == modname
    }
    unscanned = sorted(own - source)
    if unscanned:
        problems.append(f"the module defines names the .pyx scan missed: {unscanned}")

    tree = ast.parse(stub.read_text(), filename=str(stub))
    defined, reexported, classes = stub_names(tree)
    stale = sorted(defined - source)
    missing = sorted(source - defined)
    if stale:
        problems.append(f"stub names that {modname} does not define (moved or renamed?): {stale}")
    if missing:
        problems.append(f"public names of {modname} missing from the stub: {missing}")
    uncovered = sorted(set(getattr(module, "__all__", ())) - defined - reexported)
    if uncovered:
        problems.append(
            f"__all__ names neither defined nor re-exported ('from x import N as N') in the stub: {uncovered}"
        )

    for cname, node in sorted(classes.items()):
        cls = getattr(module, cname, None)
        if not isinstance(cls, type):
            continue  # already reported as stale above
        methods, attrs = class_members(node)
        gone = sorted(m for m in methods if not hasattr(cls, m))
        if gone:
            problems.append(f"{cname}: stub methods the compiled class lacks: {gone}")
        # Instance attributes of a class with an instance __dict__ cannot be seen on the
        # class; extension types and __slots__ classes expose each one as a descriptor.
        if "__dict__" not in dir(cls):
            gone = sorted(a for a in attrs if not hasattr(cls, a))
            if gone:
                problems.append(f"{cname}: stub attributes the compiled class lacks: {gone}")
        undeclared = sorted(compiled_public_methods(cls) - methods)
        if undeclared:
            problems.append(f"{cname}: public methods of the compiled class missing from the stub: {undeclared}")

    assert not problems, f"{stub.relative_to(PACKAGE.parent)} is out of date:\n  " + "\n  ".join(problems)
