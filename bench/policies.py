"""Policy comparison: the same seeded burst workload against static, dynamic and smart.

This is ``velocityllm bench`` with the same flags and defaults; see bench/README.md for
how it measures. Example::

    python -m bench.policies --repeats 3 --output bench/results/policies
    python -m bench.policies --smoke --output /tmp/policies   # every policy once, tiny: it works
"""

from __future__ import annotations

import argparse
import sys

from velocity_fast.loadgen.bench_cmd import add_bench_arguments, bench_main

# --smoke: every policy once on a tiny burst (CI: tests/bench/); flags given still win.
SMOKE = {
    "num_requests": 24,
    "duration": 1.0,
    "prompt_tokens": "uniform:16:64",
    "output_tokens": "uniform:4:12",
    "repeats": 1,
    "warmup_requests": 2,
    "no_plots": True,
    "no_progress": True,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny (" + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + "): checks that it runs",
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**SMOKE)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
