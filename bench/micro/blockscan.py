"""Instructions to decode a chat request and find its prefix blocks, by prompt size: the
paths the router has taken, from the Python rendering to the request scanner.

Method: machine instructions counted by valgrind's callgrind, which do not drift with the
machine's load. For each body size and path, one run of this script under callgrind does
a warm-up call of every path, then N calls of the path measured; a run with N = 0 is the
baseline, and (total - baseline) / N is one call. The bodies are chat histories (a system
prompt, then user and assistant turns of about 1.5 KiB of English text with newlines,
quotes, and a little non-ASCII), the same bytes in every run (bench/overhead.py's
chat_body).

Paths, each one call per request:
  msgspec   msgspec decodes the whole body (messages kept raw): the decoder before the scanner
  decode    decode_proxy(body): the request scanner (csrc/reqscan.h), then msgspec on the
            members the gateway reads
  old       msgspec + render_prompt (messages decoded to Python objects, rendered) + hash:
            the first path
  rendered  msgspec + hash_messages(raw messages): the rendering scanner (csrc/prompt_render.h),
            the second
  new       decode + hash_json(raw messages, compact): the JSON text hashed where it lies
            (the decoder left it compact), the path now

    python -m bench.micro.blockscan [--sizes 1,4,16,64,256] [--json out.json]
    python -m bench.micro.blockscan --smoke     # two sizes, few calls: it works

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

ROOT = Path(__file__).resolve().parents[2]

PATHS = ("msgspec", "decode", "old", "rendered", "new")
MODEL = "fixed"


def _worker(kib: int, path: str, n: int) -> None:
    import msgspec

    from bench.lib.bodies import chat_body
    from velocity_fast.gateway.request_types import ProxyRequest
    from velocity_fast.gateway.requests import decode_proxy, decode_proxy_compact
    from velocity_fast.routing.blockscan import hash_json, hash_messages
    from velocity_fast.routing.prefix import PrefixHasher
    from velocity_fast.routing.prefix_render import json_text, render_prompt

    body = chat_body(kib, MODEL)
    hasher = PrefixHasher(64)
    whole = msgspec.json.Decoder(ProxyRequest).decode

    def msgspec_decode():
        return whole(body)

    def decode():
        return decode_proxy(body, True)

    def old():
        r = whole(body)
        r.prompt = None  # (the schema keeps it raw now; the old one decoded it, to None here)
        return hasher.hash(render_prompt(r), MODEL)

    def rendered():
        return hash_messages(whole(body).messages, hasher, MODEL)

    def new():  # as the exchange and the router call them
        r, compact = decode_proxy_compact(body, True)
        return hash_json(r.messages, hasher, MODEL, compact)

    calls = {"msgspec": msgspec_decode, "decode": decode, "old": old, "rendered": rendered, "new": new}
    # Each path gives its rendering's blocks, or the comparison means nothing.
    if old().tolist() != rendered().tolist():
        raise SystemExit("the rendering scanner's blocks differ from the Python rendering's")
    if new().tolist() != hasher.hash(json_text(decode().messages), MODEL).tolist():
        raise SystemExit("hash_json's blocks differ from json_text's")
    fn = calls[path]
    for _ in range(n):
        fn()


def _count(kib: int, path: str, n: int, tmp: str) -> int:
    p = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={tmp}/cg.{kib}.{path}.{n}",
            sys.executable,
            "-m",
            "bench.micro.blockscan",
            "--_worker",
            str(kib),
            path,
            str(n),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        # No counted run writes a .pyc (only the first would): the runs differ in N only.
        env={"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"},
        timeout=900,
    )
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"callgrind run failed ({p.returncode}): {p.stderr[-800:]}")
    return int(m.group(1))


def measure(sizes: list[int], budget_kib: int) -> list[dict]:
    rows = []
    # Once outside callgrind, so that no counted run compiles and writes .pyc files.
    subprocess.run(
        [sys.executable, "-m", "bench.micro.blockscan", "--_worker", str(sizes[0]), "msgspec", "0"],
        check=True,
        timeout=120,
        cwd=ROOT,
    )
    with tempfile.TemporaryDirectory(prefix="velocity-blockscan-") as tmp:
        for kib in sizes:
            n = max(16, budget_kib // kib)  # (fewer calls of a large body drown in the noise of GC passes)
            base = _count(kib, "msgspec", 0, tmp)
            row = {"kib": kib, "calls": n}
            for path in PATHS:
                row[path] = (_count(kib, path, n, tmp) - base) / n
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    b = r["kib"] * 1024
    return (
        f"{r['kib']:>6} {r['msgspec']:>11,.0f} {r['decode']:>11,.0f} {r['old']:>11,.0f} {r['rendered']:>11,.0f} "
        f"{r['new']:>11,.0f} {r['old'] / r['new']:>7.1f}x {r['old'] / b:>7.2f} {r['rendered'] / b:>7.2f} "
        f"{r['new'] / b:>7.2f}"
    )


HEADER = (
    f"{'KiB':>6} {'msgspec':>11} {'decode':>11} {'old':>11} {'rendered':>11} {'new':>11} {'old/new':>8} "
    f"{'old i/B':>7} {'rend i/B':>7} {'new i/B':>7}"
)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        _worker(int(argv[1]), argv[2], int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,64,256", help="body sizes in KiB (default 1,4,16,64,256)")
    p.add_argument(
        "--budget-kib",
        type=int,
        default=2048,
        help="KiB of bodies per measured run: calls = budget / size, at least 16 (default 2048)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--smoke", action="store_true", help="sizes 1,16 and a small budget: checks that it runs")
    if "--smoke" in argv:
        p.set_defaults(sizes="1,16", budget_kib=64)
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print("Instructions per call (callgrind); i/B = instructions per body byte")
    print(HEADER, flush=True)
    rows = measure(sizes, args.budget_kib)
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes_kib": sizes, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
