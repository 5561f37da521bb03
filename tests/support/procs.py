"""The machine's processes as /proc shows them (tests that look for children or groups)."""

from __future__ import annotations

import os
from typing import Iterator


def stat_fields() -> Iterator[tuple[int, list[str]]]:
    """(pid, the /proc/PID/stat fields after the command name: state, ppid, pgrp, ...) of
    every process that can still be read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    yield int(entry), f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
