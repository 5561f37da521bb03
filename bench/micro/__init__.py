"""Micro benchmarks (pytest-benchmark files ``bench_*.py``) and instruction counts."""
