"""Where a count lives is state/'s business: no module outside it names a raw shared-memory
operation or struct (``vf_*``, csrc/shared_state.h); they hold a slot and call state/shm.pxd's
typed functions (or hold a Bucket and call its draw, settle, left)."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "velocity_fast"
RAW = re.compile(r"\bvf_\w+")


def test_no_module_outside_state_names_a_raw_shared_operation():
    found = []
    for path in sorted(PKG.rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxd") or "state" in path.relative_to(PKG).parts[:1]:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if RAW.search(line):
                found.append(f"{path.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert found == [], "raw shared-memory operations outside velocity_fast/state/:\n" + "\n".join(found)
