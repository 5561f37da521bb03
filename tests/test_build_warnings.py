"""The compiled core builds without a compiler warning (`make run` prints none).

Every C file cythonize generated (``velocity_fast/**/*.c``, beside its ``.pyx``) is compiled
again with the warning flags the build uses (Python's own CFLAGS, ``-Wall`` among them)
and the headers of ``csrc/``. Optimisation is off to keep this quick: the warnings that
matter here (unused functions of a shared header, sign comparisons, unused variables)
do not depend on it.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def _flags() -> list[str]:
    cflags = [
        f
        for f in (sysconfig.get_config_var("CFLAGS") or "").split()
        if f.startswith("-W") or f.startswith("-D") or f == "-fwrapv"
    ]
    return cflags + ["-Wall", "-O0", "-I", str(REPO / "csrc"), "-I", sysconfig.get_paths()["include"]]


def test_the_generated_c_compiles_without_warnings():
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler: the compiled core cannot have been built here either"
    sources = sorted(REPO.glob("velocity_fast/**/*.c"))
    assert sources, "no generated C: build in place first (setup.py build_ext --inplace)"

    def compile_one(c: Path) -> str:
        r = subprocess.run(
            [cc, "-c", "-o", "/dev/null", *_flags(), str(c)], capture_output=True, text=True, timeout=240
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stderr

    with ThreadPoolExecutor(max_workers=2) as pool:
        warnings = [line for out in pool.map(compile_one, sources) for line in out.splitlines() if "warning:" in line]
    assert warnings == [], f"{len(warnings)} compiler warnings, e.g. {sorted(set(warnings))[:5]}"
