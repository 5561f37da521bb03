"""The instruction ratchet: machine instructions per request on the request path, against
a committed baseline, so that small increments cannot add up unseen.

Each scenario is bench/inprocess.py's harness under callgrind (the real request path on
fake transports, no sockets), counted as `python -m bench.inprocess --instructions` counts
it: two runs of the same scenario, SMALL and LARGE requests, and the difference of their
totals over the extra requests (start-up and imports cancel out). No sockets, no other
process and a fixed hash seed: two counts of the same tree agree within about 0.5 % (admission's
timers fire by the wall clock, and callgrind's pace follows the machine's load), where
bench/instructions.py (callgrind on the real server under wrk) repeats only to about
+-3 %, too loose for a 3 % gate.

The baseline is bench/ratchet.json, one scenario a line. tests/bench/test_ratchet.py fails
when a scenario counts more than TOLERANCE above it. A change that lowers a count lowers
its line (one-line commit that says why); a change that must cost more says so in its
commit and raises it. `--write` rewrites the file from this tree's counts.

    python -m bench.ratchet            # count every scenario, compare with the baseline
    python -m bench.ratchet --write    # count, then rewrite bench/ratchet.json
    python -m bench.ratchet --only 150b-tenant

Needs valgrind. The counts depend on the interpreter and the compiled libraries (the
venv's versions, glibc's string functions), so a baseline holds for one build image.
About 40 s on two idle cores (two callgrind runs at a time), 95 s beside other work.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.inprocess import instructions

BASELINE = Path(__file__).resolve().parent / "ratchet.json"
TOLERANCE = 0.03
SMALL, LARGE = 200, 1200
CONNECTIONS = 64
# name -> bench.inprocess.instructions() keywords.
SCENARIOS: dict[str, dict] = {
    "150b": {},  # the small chat request, no tenant
    "150b-tenant": {"tenant": True},  # one tenant named by header, a token quota, token fairness
    "16kib-smart": {"body_kb": 16, "policy": "smart"},  # a 16 KiB chat prompt, prefix affinity on
    "150b-stream": {"stream_events": 8},  # streamed: 8 token events, then [DONE]
    "150b-sdk": {"sdk_head": True},  # the small request with the OpenAI SDK's 17-line head
}


def count(name: str) -> float:
    return instructions(CONNECTIONS, small=SMALL, large=LARGE, **SCENARIOS[name])


def count_all(names: list[str], jobs: int = 2) -> dict[str, float]:
    # Each run is one single-threaded process: two at a time use both cores.
    with ThreadPoolExecutor(jobs) as pool:
        return dict(zip(names, pool.map(count, names)))


def read_baseline(path: Path = BASELINE) -> dict[str, int]:
    return json.loads(path.read_text())


def write_baseline(counts: dict[str, float], path: Path = BASELINE) -> None:
    old = read_baseline(path) if path.exists() else {}
    new = {**old, **{k: round(v) for k, v in counts.items()}}
    lines = ",\n".join(f'  "{k}": {new[k]}' for k in SCENARIOS if k in new)
    path.write_text("{\n" + lines + "\n}\n")


def over(counts: dict[str, float], base: dict[str, int]) -> dict[str, float]:
    """Scenarios above their baseline by more than TOLERANCE: name -> ratio."""
    return {k: v / base[k] for k, v in counts.items() if k in base and v > base[k] * (1 + TOLERANCE)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite bench/ratchet.json from this tree's counts")
    p.add_argument("--only", default=None, metavar="LIST", help="a comma-separated subset of " + ", ".join(SCENARIOS))
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"--only: unknown scenario {unknown[0]!r} (known: {', '.join(SCENARIOS)})")
    counts = count_all(names, a.jobs)
    base = read_baseline() if BASELINE.exists() else {}
    for k, v in counts.items():
        b = base.get(k)
        rel = f"{v / b - 1:+.2%} against {b:,}" if b else "no baseline"
        print(f"{k:12} {v:10,.0f} instructions per request  ({rel})")
    if a.write:
        write_baseline(counts)
        print(f"wrote {BASELINE}")
        return 0
    bad = over(counts, base)
    for k, r in bad.items():
        print(f"{k}: {r - 1:+.2%}, more than {TOLERANCE:.0%} above its baseline")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
