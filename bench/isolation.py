"""Priority isolation at default flags: does `high` traffic keep its latency while `low` floods?

Method (velocity_fast/loadgen/isolation.py)
------
* Sim engines the gateway is not told about (2x real time, 50 tokens/s per sequence),
  `velocityllm serve` in front of them with nothing but `--policy`: the defaults a user
  runs (max-concurrency 32 per engine, the server's SLA of 3 s, bands 1.5/1.0/0.8).
* Idle: --high-samples short `high` streaming chat requests (24 tokens), one every
  --spacing seconds, each timed from writing the request to the last byte.
* Loaded: --low `low` clients keep a 96-token chat request in flight each (a declined
  one waits a second, as a client told Retry-After does), --backlog seconds to build up,
  then the same `high` series again while the flood goes on.
* Figure: high p95 loaded / idle per policy. Target for `dynamic`: <= 1.5x; `static`
  (one FIFO, the same limit) shows what admission buys, and that the load is real.
* `--matrix` runs every engine set: two engines of 8, 16 or 64 sequences, two whose
  batch is bound by KV blocks (256 sequences allowed, 160 blocks), and one of 8 beside
  one of 64. Without it, one set (--scenario, default seqs-16).
* `--at SECONDS`: the first seconds instead of the learned state. The loaded series
  starts that long after the flood does, nothing learned or waited for (0: together).
* `--long`: longer requests at the sim's own speed (real time): low of about 125 prompt
  tokens and 200 out, high of 8; the KV-bound engines get 256 blocks.

Every process is on 127.0.0.1 and is stopped at the end, also on error or Ctrl-C.
Usage::

    python -m bench.isolation [--matrix | --scenario NAME] [--policies dynamic,static]
                              [--low 300] [--at 3] [--long] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

from velocity_fast.loadgen.isolation import KV_BOUND_LONG, LONG, SCENARIOS, matrix
from velocity_fast.loadgen.report import write_json

TARGET = 1.5
STATIC_AT_LEAST = 10.0
LONG_SCENARIOS = {**SCENARIOS, "kv-bound": KV_BOUND_LONG}


def table(runs: list[dict]) -> str:
    lines = [
        f"{'engines':<11} {'policy':<8} {'idle p95':>9} {'loaded p95':>11} {'ratio':>7}  "
        f"{'low ok':>6} {'declined':>8}  learned batch"
    ]
    for r in runs:
        lines.append(
            f"{r['scenario']:<11} {r['policy']:<8} {r['idle_ms']['p95']:7.0f}ms {r['loaded_ms']['p95']:9.0f}ms "
            f"{r['p95_ratio']:6.2f}x  {r['low']['ok']:>6} {r['low']['declined']:>8}  "
            f"{r['batch_capacity']}"
        )
    by = {}
    for r in runs:
        by.setdefault(r["scenario"], {})[r["policy"]] = r
    for name, pols in by.items():
        d, s = pols.get("dynamic"), pols.get("static")
        verdict = []
        if d:
            verdict.append(f"dynamic {'meets' if d['p95_ratio'] <= TARGET else 'MISSES'} <= {TARGET}x")
        if s:
            verdict.append(
                f"static {s['p95_ratio']:.1f}x ({'real load' if s['p95_ratio'] >= STATIC_AT_LEAST else 'load NOT shown'})"
            )
        lines.append(f"  {name}: " + "; ".join(verdict))
    return "\n".join(lines)


async def main_async(args) -> int:
    names = list(SCENARIOS) if args.matrix else [args.scenario]
    kw = dict(low=args.low, high_samples=args.high_samples, spacing=args.spacing, backlog=args.backlog, at=args.at)
    scenarios = LONG_SCENARIOS if args.long else SCENARIOS
    if args.long:
        kw.update(LONG)
    with tempfile.TemporaryDirectory(prefix="isolation-") as log_dir:
        runs = await matrix(
            {n: scenarios[n] for n in names}, [p.strip() for p in args.policies.split(",")], log_dir, **kw
        )
    low_t, high_t = (200, 8) if args.long else (96, 24)
    when = (
        f"from {args.at:g} s into the flood, nothing learned first"
        if args.at is not None
        else "once what admission learns has settled"
    )
    print(
        f"isolation at default flags: {args.low} low clients ({low_t} tokens) against {args.high_samples} high "
        f"streaming requests ({high_t} tokens, one every {args.spacing} s) {when}; "
        f"figure = high p95 loaded / idle"
    )
    print(table(runs))
    if args.json:
        write_json(args.json, {"args": vars(args), "target_dynamic_p95_ratio": TARGET, "runs": runs})
    failed = any(r["idle_ms"]["failed"] or r["loaded_ms"]["failed"] for r in runs)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--matrix", action="store_true", help="every engine set, not one")
    p.add_argument("--scenario", default="seqs-16", choices=list(SCENARIOS))
    p.add_argument("--policies", default="dynamic,static", help="comma-separated: dynamic, static, smart")
    p.add_argument("--low", type=int, default=300, help="low clients, one request in flight each")
    p.add_argument("--high-samples", type=int, default=60, help="high requests per series")
    p.add_argument("--spacing", type=float, default=0.1, help="seconds between high requests")
    p.add_argument("--backlog", type=float, default=4.0, help="seconds of flood before measuring")
    p.add_argument(
        "--at",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the first seconds: the loaded series starts this long after the flood, nothing learned first",
    )
    p.add_argument("--long", action="store_true", help="200-token low, 8-token high, sims at real time")
    p.add_argument("--json", default=None, metavar="PATH", help="write the runs as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny counts: one engine set, a few seconds a policy")
    args = p.parse_args(argv)
    if args.smoke:
        args.matrix = False
        args.scenario = "seqs-8"
        args.low, args.high_samples, args.backlog = 40, 8, 1.5
    if args.low < 1 or args.high_samples < 1:
        p.error("--low and --high-samples must be at least 1")
    if args.at is not None and args.at < 0:
        p.error("--at must be 0 or more")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
