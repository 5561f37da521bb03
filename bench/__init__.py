"""The benchmarks, each a module run from the repository root: ``python -m bench.NAME``
(bench/README.md). What they share is in ``bench.lib``."""
