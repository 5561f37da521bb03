"""``velocityllm bench``: the same seeded workload against each admission policy.

For every repeat, the policies run in a shuffled order (so that drift of a shared
machine does not always favour the same one); each run starts a fresh gateway with
sim engines, waits for admin ``/ready``, warms up, plays the identical workload while
sampling admin ``/stats``, and stops the gateway. The table shows medians over the
repeats. Nothing heavy is imported at module top.
"""

from __future__ import annotations

import argparse
import re

from .flags import add_client_arguments, add_workload_arguments

POLICIES = ("static", "dynamic", "smart")

# The default workload: bursts that push the default sim setup (2 engines) well past
# its capacity, short enough that three policies x three repeats take about 2 minutes.
BENCH_DEFAULTS = {
    "pattern": "burst",
    "num_requests": 240,
    "duration": 8.0,
    "prompt_tokens": "uniform:64:256",
    "output_tokens": "uniform:32:96",
    "sla_ms": 3000.0,
}


def peak_rate(num_requests: int, duration: float, pattern: str) -> float:
    """The highest arrival rate (req/s) a pattern asks for; flood has no finite rate."""
    mean = num_requests / duration
    if pattern == "burst":
        from .arrivals import BURST_BASE_SHARE, BURST_WINDOWS

        width = sum(hi - lo for lo, hi in BURST_WINDOWS) * duration
        return mean * BURST_BASE_SHARE + num_requests * (1 - BURST_BASE_SHARE) / width
    if pattern == "flood":
        return float("inf")
    return mean


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """All flags of ``velocityllm bench``."""
    add_workload_arguments(parser)
    add_client_arguments(parser)
    parser.set_defaults(**BENCH_DEFAULTS)
    # The shared workload flags' help gives loadgen's defaults; bench's own are these.
    for action in parser._actions:
        if action.dest in BENCH_DEFAULTS and action.help:
            action.help = re.sub(r"\(default [^)]*\)", "(default %(default)s)", action.help)
        if action.dest == "sla_ms":  # bench sends its SLA with every request, given or not
            action.help = "SLA in ms that judges goodput, sent as x-velocity-sla-ms (default %(default)s)"
    g = parser.add_argument_group("bench")
    g.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated policies to compare (default %(default)s)"
    )
    from velocity_fast.engines.flags import DEFAULT_SIM_ENGINES

    g.add_argument(
        "--engines",
        type=int,
        default=DEFAULT_SIM_ENGINES,
        help=f"sim engines per gateway (default {DEFAULT_SIM_ENGINES}, as chargeVelocity)",
    )
    g.add_argument(
        "--repeats", type=int, default=3, help="runs per policy; the table shows medians (default %(default)s)"
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=8,
        help="requests sent over 0.5 s before each run, to open connections and give "
        "the estimators a first sample (default 8)",
    )
    g.add_argument(
        "--stats-interval", type=float, default=0.25, help="seconds between /stats samples (default %(default)s)"
    )
    g.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for /ready (default %(default)s)")
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for chargeVelocity (repeatable), e.g. --server-arg=--sla-ms=2000",
    )
    g.add_argument(
        "--no-request-sla",
        action="store_true",
        help="send no request with an SLA of its own (no x-velocity-sla-ms, not even a "
        "band's): the gateway's SLA applies, set to --sla-ms unless --server-arg "
        "gives one; --sla-ms still judges goodput",
    )
    g.add_argument(
        "--output",
        metavar="PREFIX",
        default="bench/results/policies",
        help="write PREFIX.json, PREFIX.csv, PREFIX_runs.csv and PNG plots, relative to the "
        "current folder, whose folder is made if missing (default %(default)s)",
    )
    g.add_argument("--no-plots", action="store_true", help="do not write PNG plots")


def overload(runs: list[dict], peak_arrival_rps: float) -> dict:
    """How far the peak arrivals exceed what the engines delivered at best.

    Capacity is taken as the highest completion rate seen in any run (a 1 s window):
    during an overloaded burst that is the service rate of the engines for this mix.
    """
    cap = max((r["summary"].get("peak_completion_rps", 0.0) for r in runs), default=0.0)
    return {
        "capacity_rps": cap,
        "peak_arrival_rps": peak_arrival_rps,
        "overload": peak_arrival_rps / cap if cap > 0 else float("inf"),
    }


def bench_setup(args):
    """(WorkloadConfig, mix, request specs, extra gateway arguments) of a bench run.

    By default every request carries --sla-ms (or its band's) as x-velocity-sla-ms; with
    --no-request-sla none does, and the gateways get --sla-ms as their own SLA instead,
    so that goodput is judged by the SLA the gateway worked to."""
    import dataclasses

    from .app import workload_config
    from .mix import mix_from_args
    from .workload import build_workload

    cfg = workload_config(args, "127.0.0.1")
    server_args = list(args.server_arg)
    if args.no_request_sla:
        cfg = dataclasses.replace(cfg, send_sla=False, request_sla=False)
        if not any(a == "--sla-ms" or a.startswith("--sla-ms=") for a in server_args):
            server_args.append(f"--sla-ms={cfg.sla_ms:g}")
    mix = mix_from_args(args)
    return cfg, mix, build_workload(cfg, mix), server_args


def sim_args(mix, server_args: list[str]) -> list[str]:
    """The sims' flags a bench run adds to ``server_args``: a client that names no
    max_tokens still gets a reply of the workload's length, so the sims end such replies
    by themselves at the mix's mean output length, and the share changes what the body
    says, not how much work the engines are given (none when --sim-args is given)."""
    if mix.clients.no_max_tokens <= 0 or any(a == "--sim-args" or a.startswith("--sim-args=") for a in server_args):
        return []
    return [f"--sim-args=--natural-output-mean {round(mean_length(mix.output_tokens))}"]


def mean_length(d) -> float:
    """The mean of a length distribution (``mix.Dist``), before its clamp."""
    import math

    if d.dist == "uniform":
        return (d.low + d.high) / 2
    if d.dist == "lognormal":
        return d.value * math.exp(d.sigma**2 / 2)
    return d.value


def run_config(args, cfg) -> dict:
    """The run's flags as JSON, with the workload as it ran: ``--rate`` sets the duration
    (N / rate), which the ``--duration`` flag's value would misstate."""
    from .report import plain_args

    return {**plain_args(args), "duration": cfg.duration, "duration_s": cfg.duration}


def run_order(policies: list[str], repeats: int, seed: int) -> list[tuple[int, str]]:
    """(repeat, policy) pairs: each repeat visits every policy once, shuffled by the seed."""
    import random

    out = []
    for r in range(repeats):
        order = list(policies)
        random.Random(f"order:{seed}:{r}").shuffle(order)
        out.extend((r, p) for p in order)
    return out


def bench_main(args) -> int:
    """Run ``velocityllm bench``; 0 when every run completed, 1 when a gateway failed."""
    import os
    import sys
    import tempfile

    import msgspec

    from .app import describe
    from .compare import format_table, medians, verdict
    from .report import print_to, write_csv, write_json

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies or args.repeats < 1:
        print(f"bench: unknown policies {bad}" if bad else "bench: need policies and --repeats >= 1", file=sys.stderr)
        return 2
    try:
        cfg, mix, specs, server_args = bench_setup(args)
    except (ValueError, OSError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(args.output)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    print_to(
        sys.stdout,
        describe(cfg, args.concurrency, f"gateway + {args.engines} sim engines per policy")
        + f"; peak {peak_rate(cfg.num_requests, cfg.duration, cfg.pattern):.1f} req/s",
    )
    logs = tempfile.mkdtemp(prefix="velocity-bench-")
    runs = _run_all(args, policies, cfg, mix, specs, logs, server_args)
    if runs is None:
        print(f"bench: a gateway failed; logs in {logs}", file=sys.stderr)
        return 1
    meds = medians(runs)
    load = overload(runs, peak_rate(cfg.num_requests, cfg.duration, cfg.pattern))
    print_to(sys.stdout, "")
    print_to(sys.stdout, format_table(meds, policies))
    for line in verdict(meds, policies):
        print_to(sys.stdout, line)
    print_to(
        sys.stdout,
        f"observed capacity {load['capacity_rps']:.1f} req/s (most completions in any "
        f"1 s, all runs); peak arrival rate {load['peak_arrival_rps']:.1f} req/s = "
        f"{load['overload']:.2f}x capacity",
    )
    write_json(
        args.output + ".json",
        {
            "config": run_config(args, cfg),
            "mix": msgspec.to_builtins(mix),
            "medians": meds,
            "load": load,
            "runs": [{k: v for k, v in r.items() if k != "latencies"} for r in runs],
        },
    )
    write_csv(
        args.output + ".csv",
        ({"policy": p, **m} for p, m in meds.items()),
        fields=["policy", *next(iter(meds.values())).keys()],
    )
    run_rows = [
        {
            "repeat": r["repeat"],
            "policy": r["policy"],
            **{
                k: r["summary"][k]
                for k in (
                    "requests",
                    "completed",
                    "good",
                    "goodput_rps",
                    "goodput_ratio",
                    "throughput_rps",
                    "duration_s",
                )
            },
            "latency_p50_ms": r["summary"]["latency_ms"]["p50"],
            "latency_p99_ms": r["summary"]["latency_ms"]["p99"],
        }
        for r in runs
    ]
    write_csv(args.output + "_runs.csv", run_rows, fields=list(run_rows[0].keys()))
    written = [args.output + ".json", args.output + ".csv", args.output + "_runs.csv"]
    from .plots import have_matplotlib, write_plots

    if not args.no_plots and have_matplotlib():
        lat: dict[str, list[float]] = {}
        tl: dict[str, list[tuple]] = {}
        for r in runs:
            lat.setdefault(r["policy"], []).extend(r["latencies"])
            tl.setdefault(r["policy"], r["timeline"])
        written.extend(write_plots(args.output, lat, tl, sla_ms=cfg.sla_ms))
    elif not args.no_plots:
        print_to(sys.stdout, "matplotlib not installed: no plots (pip install 'velocityllm[bench]')")
    print_to(sys.stdout, "wrote " + ", ".join(written))
    return 0


def _run_all(args, policies, cfg, mix, specs, logs, server_args):
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(_bench(args, policies, cfg, mix, specs, logs, server_args))
    return uvloop.run(_bench(args, policies, cfg, mix, specs, logs, server_args))


async def _bench(args, policies, cfg, mix, specs, logs, server_args):
    import asyncio
    import dataclasses
    import os
    import sys
    import time

    from .gateway_proc import GatewayProcess, gauges
    from .report import print_to
    from .runner import run_workload
    from .stats import summarize
    from .workload import build_workload

    # A different seed so that warm-up does not pre-fill the prefix caches with the
    # measured prompts.
    warm_specs = build_workload(
        dataclasses.replace(
            cfg, num_requests=max(1, args.warmup_requests), pattern="constant", duration=0.5, seed=cfg.seed + 1_000_003
        ),
        mix,
    )
    runs = []
    for repeat, policy in run_order(policies, args.repeats, cfg.seed):
        gw = GatewayProcess(
            policy,
            engines=args.engines,
            extra=server_args + sim_args(mix, server_args),
            log_path=os.path.join(logs, f"{policy}-{repeat}.log"),
        )
        gw.spawn()
        try:
            await gw.wait_ready(args.ready_timeout)
            if args.warmup_requests > 0:
                await run_workload(warm_specs, "127.0.0.1", gw.port, concurrency=args.concurrency, timeout=args.timeout)
            timeline: list[tuple] = []
            t0 = time.perf_counter()
            sampling = [True]

            async def sample():
                # A flag, not only cancel(): on Python 3.11 wait_for() can swallow a
                # cancellation that lands as its inner call completes, and the sampler
                # would then poll forever.
                while sampling[0]:
                    st = await gw.stats()
                    if st is not None:
                        timeline.append((time.perf_counter() - t0, *gauges(st)))
                    await asyncio.sleep(args.stats_interval)

            sampler = asyncio.get_running_loop().create_task(sample())
            try:
                outcome = await run_workload(
                    specs, "127.0.0.1", gw.port, concurrency=args.concurrency, timeout=args.timeout
                )
            finally:
                sampling[0] = False
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        except RuntimeError as e:
            print(f"bench: {e}", file=sys.stderr)
            return None
        finally:
            await asyncio.to_thread(gw.close)  # the gateway, then anything of its group
        summary = summarize(specs, outcome.results, start=outcome.start, cpu_seconds=outcome.cpu_seconds)
        latencies = [(r.done - r.sent) * 1000.0 for r in outcome.results if r.ok]
        runs.append(
            {"repeat": repeat, "policy": policy, "summary": summary, "timeline": timeline, "latencies": latencies}
        )
        print_to(
            sys.stdout,
            f"[{len(runs)}] {policy:<8} repeat {repeat}: goodput {summary['goodput_rps']:.2f} "
            f"req/s ({100 * summary['goodput_ratio']:.0f}% in SLA), completed "
            f"{summary['completed']}/{summary['requests']}, p99 "
            f"{summary['latency_ms']['p99']:.0f} ms",
        )
        levels = "; ".join(
            f"{lv['rate_min']}-{lv['rate_max']}/s: {lv['missed']}/{lv['completed']}" for lv in summary["by_load"]
        )
        print_to(sys.stdout, f"    admitted past the SLA by arrival rate: {levels}")
    return runs
