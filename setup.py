"""Build the compiled core: every velocity_fast/_core/*.pyx through cythonize.

VELOCITY_EXT=bands,prefix restricts the build to the named modules (useful while
one module is being edited and another is not yet compilable).
"""
import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
CORE = HERE / "velocity_fast" / "_core"

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
for pyx in sorted(CORE.glob("*.pyx")):
    if only and pyx.stem not in only:
        continue
    extensions.append(
        Extension(
            f"velocity_fast._core.{pyx.stem}",
            [str(pyx.relative_to(HERE))],
            include_dirs=["csrc"],
            extra_compile_args=["-O3"],
        )
    )

if not only or "blockscan" in only:  # the one compiled module outside _core
    extensions.append(Extension("velocity_fast.routing.blockscan", ["velocity_fast/routing/blockscan.pyx"], include_dirs=["csrc"], extra_compile_args=["-O3"]))
setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, annotate=False))
