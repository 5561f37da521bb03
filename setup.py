"""Build the compiled modules: every velocity_fast/**/*.pyx through cythonize.

The hot classes are compiled in the package of their concept (docs/design.md, "Layers").
VELOCITY_EXT=bands,prefix restricts the build to the named modules (useful while
one module is being edited and another is not yet compilable).
"""

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
PKG = HERE / "velocity_fast"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "embedsignature": True,
}

only = {n for n in os.environ.get("VELOCITY_EXT", "").split(",") if n}
extensions = []
for pyx in sorted(PKG.rglob("*.pyx")):
    if only and pyx.stem not in only:
        continue
    rel = pyx.relative_to(HERE)
    extensions.append(
        Extension(
            ".".join(rel.with_suffix("").parts),
            [str(rel)],
            include_dirs=["csrc"],
            extra_compile_args=["-O3"],
        )
    )

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, annotate=False))
