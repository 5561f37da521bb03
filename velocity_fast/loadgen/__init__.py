"""Load generator and policy benchmark: seeded workloads, an httptools client, reports.

The command entry points live in ``app.py`` (``velocityllm loadgen``) and
``bench_cmd.py`` (``velocityllm bench``); their flags in ``flags.py`` and
``bench_cmd.add_bench_arguments``. Nothing heavy is imported here so that
``velocityllm --help`` stays fast.
"""
