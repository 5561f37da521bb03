"""Policy comparison: the same seeded burst workload against static, dynamic and smart.

This is ``velocityllm bench`` with the same flags and defaults; see bench/README.md for
how it measures. Example::

    python bench/policies.py --repeats 3 --output bench/results/policies
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from velocity_fast.loadgen.bench_cmd import add_bench_arguments, bench_main  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
