"""``make bench``: the quick benchmark set, each in its own subprocess, one summary.

Each benchmark's full output goes to bench/results/<name>.log; the summary shows
whether it ran, how long it took and the last lines of its own report. A benchmark
whose file does not exist yet is skipped with a note. Exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TAIL_LINES = 14


def quick_set(py: str) -> list[tuple[str, list[Path], list[str]]]:
    """(name, files that must exist, command) for each benchmark of the quick set."""
    micro = sorted((ROOT / "bench" / "micro").glob("bench_*.py"))
    return [
        ("micro", micro, [py, "-m", "pytest", *map(str, micro), "--benchmark-only", "-q",
                          "-p", "no:cacheprovider"]),
        ("inprocess", [ROOT / "bench" / "inprocess.py"], [py, str(ROOT / "bench" / "inprocess.py")]),
        ("overhead", [ROOT / "bench" / "overhead.py"], [py, str(ROOT / "bench" / "overhead.py")]),
        ("isolation", [ROOT / "bench" / "isolation.py"], [py, str(ROOT / "bench" / "isolation.py")]),
        ("prefix", [ROOT / "bench" / "prefix.py"], [py, str(ROOT / "bench" / "prefix.py")]),
        # One repeat keeps the quick set quick; `velocityllm bench` repeats three times.
        ("policies", [ROOT / "bench" / "policies.py"],
         [py, str(ROOT / "bench" / "policies.py"), "--repeats", "1", "--no-progress",
          "--output", str(RESULTS / "policies")]),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    outcomes = []
    for name, needs, cmd in quick_set(sys.executable):
        if only is not None and name not in only:
            continue
        if not needs or not all(p.exists() for p in needs):
            outcomes.append((name, "missing", 0.0, "not written yet: skipped"))
            continue
        log = RESULTS / f"{name}.log"
        print(f"running {name} ...", flush=True)
        t0 = time.monotonic()
        with open(log, "wb") as f:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        took = time.monotonic() - t0
        text = log.read_text(errors="replace").rstrip().splitlines()
        status = "ok" if rc == 0 else ("timeout" if rc is None else f"failed (exit {rc})")
        outcomes.append((name, status, took, "\n".join(text[-TAIL_LINES:])))
    print("\n" + "=" * 30 + " benchmark summary " + "=" * 30)
    for name, status, took, tail in outcomes:
        print(f"\n## {name}: {status}" + (f" in {took:.1f} s (full output: bench/results/{name}.log)"
                                          if status != "missing" else ""))
        if tail:
            print("   " + tail.replace("\n", "\n   "))
    failed = [n for n, s, _, _ in outcomes if s not in ("ok", "missing")]
    ok = [n for n, s, _, _ in outcomes if s == "ok"]
    missing = [n for n, s, _, _ in outcomes if s == "missing"]
    print(f"\n{len(ok)} ok" + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped (missing): {', '.join(missing)}" if missing else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
