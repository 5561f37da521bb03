"""py-spy samples of a process under load: the functions with the largest self and
inclusive share of the samples."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from .processes import child_setup
from .targets import REPO

# Frames of the process's entry chain: in every stack, so they say nothing about the request path.
ENTRY_FRAMES = (
    "(<frozen runpy>)",
    "(asyncio/runners.py)",
    "(velocity_fast/__main__.py)",
    "(velocity_fast/cli.py)",
    "(velocity_fast/gateway/launch.py)",
    "(velocity_fast/server/run.py)",
)


def pyspy_exe() -> str | None:
    return shutil.which("py-spy") or (
        str(Path(sys.executable).parent / "py-spy") if (Path(sys.executable).parent / "py-spy").exists() else None
    )


def profile(
    pid: int,
    seconds: float,
    load,
    raw: Path,
    *,
    native: bool = False,
    cpu: int | None = None,
    top: int = 20,
    keep: bool = False,
) -> dict:
    """Sample ``pid`` with py-spy for ``seconds`` while ``load()`` runs; top functions by
    self and total share. ``raw``: where py-spy writes its collapsed stacks (``keep``: say
    so in the result)."""
    spy = pyspy_exe()
    if spy is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    cmd = [
        spy,
        "record",
        "--format",
        "raw",
        "-r",
        "250",
        "-d",
        str(max(1, round(seconds))),
        "-p",
        str(pid),
        "-o",
        str(raw),
    ]
    # --nonblocking samples without stopping the process; py-spy cannot unwind C frames that way.
    cmd.insert(2, "--native" if native else "--nonblocking")
    spy_p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=child_setup(cpu)
    )
    try:
        time.sleep(0.5)
        load()
        out, _ = spy_p.communicate(timeout=seconds + 30)
    finally:
        if spy_p.poll() is None:
            os.killpg(spy_p.pid, signal.SIGKILL)
            spy_p.wait()
    if not raw.exists():
        return {"error": "py-spy wrote nothing: " + out.decode(errors="replace")[-300:]}
    self_c: Counter = Counter()
    incl_c: Counter = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = [re.sub(r":\d+\)$", ")", f.replace(str(REPO) + "/", "")) for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith(("process ", "thread "))] or ["?"]
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl_c[f] += n
    if not total:
        return {"error": "py-spy collected no samples"}
    inclusive = [(f, c) for f, c in incl_c.most_common() if not f.endswith(ENTRY_FRAMES)][:top]
    return {
        "samples": total,
        "raw": str(raw) if keep else None,
        "self": [(f, round(100 * c / total, 1)) for f, c in self_c.most_common(top)],
        "inclusive": [(f, round(100 * c / total, 1)) for f, c in inclusive],
    }
