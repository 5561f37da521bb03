"""Instructions to find a chat request's prefix blocks: the Python rendering against the
compiled scanner (velocity_fast/routing/blockscan.pyx), by prompt size.

Method: machine instructions counted by valgrind's callgrind, which do not drift with the
machine's load. For each body size and path, one run of this script under callgrind does
a warm-up call of every path, then N calls of the path measured; a run with N = 0 is the
baseline, and (total - baseline) / N is one call. The bodies are chat histories (a system
prompt, then user and assistant turns of about 1.5 KiB of English text with newlines,
quotes, and a little non-ASCII), the same bytes in every run (bench/overhead.py's
chat_body).

Paths, each one call per request:
  decode    decode_proxy(body): the request decoder (messages kept raw); both paths pay it
  old       decode + render_prompt (messages decoded to Python objects, rendered) + hash
  new       decode + hash_messages(raw messages): the scanner
  body      hash_body(body): the scanner over the whole body, without the decoder

    python bench/micro/blockscan.py [--sizes 1,4,16,64,256] [--json out.json]
    python bench/micro/blockscan.py --smoke     # two sizes, few calls: it works

Needs valgrind (apt-get install valgrind).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

PATHS = ("decode", "old", "new", "body")
MODEL = "fixed"


def _worker(kib: int, path: str, n: int) -> None:
    from overhead import chat_body

    from velocity_fast.gateway.requests import decode_proxy
    from velocity_fast.routing.blockscan import hash_body, hash_messages
    from velocity_fast.routing.prefix import PrefixHasher
    from velocity_fast.routing.prefix_render import render_prompt

    body = chat_body(kib, MODEL)
    hasher = PrefixHasher(64)

    def decode():
        return decode_proxy(body, True)

    def old():
        return hasher.hash(render_prompt(decode_proxy(body, True)), MODEL)

    def new():
        return hash_messages(decode_proxy(body, True).messages, hasher, MODEL)

    def whole():
        return hash_body(body, hasher, MODEL)

    calls = {"decode": decode, "old": old, "new": new, "body": whole}
    # The same blocks either way, or the comparison means nothing.
    if old().tolist() != new().tolist() or old().tolist() != whole().tolist():
        raise SystemExit("the scanner's blocks differ from the Python rendering's")
    fn = calls[path]
    for _ in range(n):
        fn()


def _count(kib: int, path: str, n: int, tmp: str) -> int:
    p = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.{kib}.{path}.{n}",
                        sys.executable, str(Path(__file__).resolve()), "--_worker", str(kib), path, str(n)],
                       capture_output=True, text=True,
                       # No counted run writes a .pyc (only the first would): the runs differ in N only.
                       env={"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"},
                       timeout=900)
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"callgrind run failed ({p.returncode}): {p.stderr[-800:]}")
    return int(m.group(1))


def measure(sizes: list[int], budget_kib: int) -> list[dict]:
    rows = []
    # Once outside callgrind, so that no counted run compiles and writes .pyc files.
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_worker", str(sizes[0]), "decode", "0"],
                   check=True, timeout=120)
    with tempfile.TemporaryDirectory(prefix="velocity-blockscan-") as tmp:
        for kib in sizes:
            n = max(4, budget_kib // kib)
            base = _count(kib, "decode", 0, tmp)
            row = {"kib": kib, "calls": n}
            for path in PATHS:
                row[path] = (_count(kib, path, n, tmp) - base) / n
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    kib = r["kib"]
    old_route, new_route = r["old"] - r["decode"], r["new"] - r["decode"]
    return (f"{kib:>6} {r['decode']:>11,.0f} {old_route:>13,.0f} {new_route:>13,.0f} {r['old']:>11,.0f} "
            f"{r['new']:>11,.0f} {r['old'] / r['new']:>7.1f}x {old_route / new_route:>7.1f}x "
            f"{new_route / (kib * 1024):>7.2f} {r['body'] / (kib * 1024):>7.2f}")


HEADER = (f"{'KiB':>6} {'decode':>11} {'old routing':>13} {'new routing':>13} {'old total':>11} "
          f"{'new total':>11} {'total':>8} {'routing':>8} {'new i/B':>7} {'body i/B':>7}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        _worker(int(argv[1]), argv[2], int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,64,256", help="body sizes in KiB (default 1,4,16,64,256)")
    p.add_argument("--budget-kib", type=int, default=2048,
                   help="KiB of bodies per measured run: calls = budget / size, at least 4 (default 2048)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--smoke", action="store_true", help="sizes 1,16 and a small budget: checks that it runs")
    if "--smoke" in argv:
        p.set_defaults(sizes="1,16", budget_kib=64)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print("Instructions per call (callgrind); routing = the path minus decode; i/B = instructions per body byte")
    print(HEADER, flush=True)
    rows = measure(sizes, args.budget_kib)
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes_kib": sizes, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
