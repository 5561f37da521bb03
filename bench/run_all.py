"""``make bench``: the quick benchmark set, each in its own subprocess, one summary.

Each benchmark's full output goes to <results>/<name>.log (default bench/results/) and
its figures, where it writes them, to <results>/<name>.json; the summary shows whether
it ran, how long it took and the last lines of its own report. A benchmark whose file
does not exist yet is skipped with a note. Exit status 1 if any failed.

``--smoke`` runs each at its smoke size (its own ``--smoke``: tiny counts and
durations, figures not meant to be quoted), to check that every benchmark still runs;
one whose script has no ``--smoke`` yet is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from velocity_fast.harness.procs import start, stop

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TAIL_LINES = 14


def quick_set(py: str, results: Path = RESULTS, smoke: bool = False) -> list[tuple[str, list[Path], list[str]]]:
    """(name, files that must exist, command) for each benchmark of the quick set."""
    micro = sorted((ROOT / "bench" / "micro").glob("bench_*.py"))
    b = ROOT / "bench"
    micro_cmd = [
        py,
        "-m",
        "pytest",
        *map(str, micro),
        "--benchmark-only",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--benchmark-json={results / 'micro.json'}",
    ]
    if smoke:  # one calibrated round each, no warm-up
        micro_cmd += ["--benchmark-min-rounds=1", "--benchmark-max-time=0", "--benchmark-warmup=off"]
    sets = [
        ("micro", micro, micro_cmd),
        ("inprocess", [b / "inprocess.py"], [py, "-m", "bench.inprocess"]),
        ("overhead", [b / "overhead.py"], [py, "-m", "bench.overhead", "--json", str(results / "overhead.json")]),
        # CPU per request against prompt size, prefix affinity on (smoke: the two ends only),
        # then the SSE relay with 64 KiB prompts.
        (
            "overhead_body_kb",
            [b / "overhead.py"],
            [
                py,
                "-m",
                "bench.overhead",
                "--body-kb",
                "1,256" if smoke else "1,4,16,64,256",
                "--stream-body-kb",
                "64",
                "--nginx-heap",
                "--json",
                str(results / "overhead_body_kb.json"),
                "--plot",
                str(results / "overhead_body_kb.png"),
            ],
        ),
        ("isolation", [b / "isolation.py"], [py, "-m", "bench.isolation", "--json", str(results / "isolation.json")]),
        ("prefix", [b / "prefix.py"], [py, "-m", "bench.prefix", "--output", str(results / "prefix.json")]),
        # One repeat keeps the quick set quick; `velocityllm bench` repeats three times.
        (
            "policies",
            [b / "policies.py"],
            [py, "-m", "bench.policies", "--repeats", "1", "--no-progress", "--output", str(results / "policies")],
        ),
        # A burst declined at an SLA: clients that retry when told against a tenth of it.
        (
            "retry_after",
            [b / "retry_after.py"],
            [py, "-m", "bench.retry_after", "--json", str(results / "retry_after.json")],
        ),
        # The same with requests that carry no SLA of their own: the server's applies.
        (
            "policies_no_sla",
            [b / "policies.py"],
            [
                py,
                "-m",
                "bench.policies",
                "--repeats",
                "1",
                "--no-progress",
                "--no-request-sla",
                "--output",
                str(results / "policies_no_sla"),
            ],
        ),
    ]
    if smoke:
        sets = [(name, needs, cmd if name == "micro" else [*cmd, "--smoke"]) for name, needs, cmd in sets]
    return sets


def has_smoke(cmd: list[str]) -> bool:
    """Whether the script a smoke command runs has a --smoke option (micro's is run_all's)."""
    if not cmd[2].startswith("bench."):  # python -m pytest
        return True
    script = ROOT / (cmd[2].replace(".", "/") + ".py")
    return script.exists() and '"--smoke"' in script.read_text(errors="replace")


def run_one(cmd: list[str], env: dict, out, timeout: float) -> int | None:
    """Run a benchmark in its own process group; its exit status, None on a timeout (then
    the group gets SIGTERM, so a benchmark stops what it started, and SIGKILL after 15 s)."""
    p = start(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(p, 15.0, whole=True)
        return None
    except BaseException:  # interrupted: stop the benchmark too
        stop(p, 15.0, whole=True)
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="each benchmark at its smoke size: checks that all still run (figures not to quote)",
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="folder of the logs and JSON figures (default bench/results)"
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    results = args.results.resolve()
    results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    outcomes = []
    for name, needs, cmd in quick_set(sys.executable, results, args.smoke):
        if only is not None and name not in only:
            continue
        if not needs or not all(p.exists() for p in needs):
            outcomes.append((name, "missing", 0.0, "not written yet: skipped"))
            continue
        if args.smoke and not has_smoke(cmd):
            outcomes.append((name, "no smoke mode", 0.0, "its script has no --smoke yet: skipped"))
            continue
        log = results / f"{name}.log"
        print(f"running {name} ...", flush=True)
        t0 = time.monotonic()
        with open(log, "wb") as f:
            rc = run_one(cmd, env, f, args.timeout)
        took = time.monotonic() - t0
        text = log.read_text(errors="replace").rstrip().splitlines()
        status = "ok" if rc == 0 else ("timeout" if rc is None else f"failed (exit {rc})")
        outcomes.append((name, status, took, "\n".join(text[-TAIL_LINES:])))
    print("\n" + "=" * 30 + " benchmark summary " + "=" * 30)
    for name, status, took, tail in outcomes:
        print(
            f"\n## {name}: {status}"
            + (
                f" in {took:.1f} s (full output: {results / name}.log)"
                if status not in ("missing", "no smoke mode")
                else ""
            )
        )
        if tail:
            print("   " + tail.replace("\n", "\n   "))
    failed = [n for n, s, _, _ in outcomes if s not in ("ok", "missing", "no smoke mode")]
    ok = [n for n, s, _, _ in outcomes if s == "ok"]
    missing = [n for n, s, _, _ in outcomes if s == "missing"]
    no_smoke = [n for n, s, _, _ in outcomes if s == "no smoke mode"]
    print(
        f"\n{len(ok)} ok"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; skipped (missing): {', '.join(missing)}" if missing else "")
        + (f"; skipped (no smoke mode): {', '.join(no_smoke)}" if no_smoke else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
