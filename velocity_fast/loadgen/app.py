"""``velocityllm loadgen``: build the seeded workload, play it, report."""

from __future__ import annotations

import sys
from urllib.parse import urlsplit

from .mix import mix_from_args
from .workload import WorkloadConfig, build_workload

DEFAULT_SLA_MS = 3000.0


def parse_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/base`` → (host, port, base path without trailing slash)."""
    u = urlsplit(url if "://" in url else "http://" + url)
    if u.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, not {u.scheme}://")
    if not u.hostname:
        raise ValueError(f"no host in {url!r}")
    return u.hostname, u.port or 80, u.path.rstrip("/")


def workload_config(args, host: str, base_path: str = "") -> WorkloadConfig:
    """The WorkloadConfig that the shared workload flags describe."""
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    duration = args.duration
    if args.rate is not None:
        if args.rate <= 0:
            raise ValueError("--rate must be > 0")
        duration = args.num_requests / args.rate
    return WorkloadConfig(
        num_requests=args.num_requests,
        pattern=args.pattern,
        duration=duration,
        seed=args.seed,
        route=args.route,
        model=args.model,
        host=host,
        api_key=args.api_key,
        sla_ms=args.sla_ms if args.sla_ms is not None else DEFAULT_SLA_MS,
        send_sla=args.sla_ms is not None,
        base_path=base_path,
    )


def describe(cfg: WorkloadConfig, concurrency: int, target: str) -> str:
    """One line saying what is about to be sent."""
    rate = (
        "all at once"
        if cfg.pattern == "flood"
        else (f"over {cfg.duration:.1f} s, mean {cfg.num_requests / cfg.duration:.1f} req/s")
    )
    return (
        f"loadgen: {cfg.num_requests} {cfg.route} requests, {cfg.pattern} {rate}, "
        f"concurrency {concurrency}, seed {cfg.seed} -> {target}"
    )


def loadgen_main(args) -> int:
    """Run ``velocityllm loadgen``; 0 when a request completed, 1 when none did, 2 for wrong flags."""
    from .report import format_summary, plain_args, print_to, request_rows, write_csv, write_json

    try:
        host, port, base = parse_url(args.url)
        cfg = workload_config(args, host, base)
        mix = mix_from_args(args)
        specs = build_workload(cfg, mix)
    except (ValueError, OSError) as e:
        print(f"loadgen: {e}", file=sys.stderr)
        return 2
    print_to(sys.stdout, describe(cfg, args.concurrency, args.url))
    outcome = run_specs(
        specs, host, port, concurrency=args.concurrency, timeout=args.timeout, show=not args.no_progress
    )
    from .stats import summarize

    summary = summarize(specs, outcome.results, start=outcome.start, cpu_seconds=outcome.cpu_seconds)
    print_to(sys.stdout, format_summary(summary))
    if args.output:
        import msgspec

        write_json(
            args.output + ".json",
            {
                "config": {**plain_args(args), "duration_s": cfg.duration},
                "mix": msgspec.to_builtins(mix),
                "summary": summary,
            },
        )
        write_csv(args.output + ".csv", request_rows(specs, outcome.results, outcome.start))
        print_to(sys.stdout, f"wrote {args.output}.json and {args.output}.csv")
    if summary["completed"] == 0:
        if all(r.status == 0 for r in outcome.results):
            print(f"loadgen: no response from {args.url} ({outcome.results[0].reason})", file=sys.stderr)
        else:
            said = "; ".join(f"{k}: {v}" for k, v in summary["rejections"]["first_error"].items())
            print("loadgen: no request completed" + (f" ({said})" if said else ""), file=sys.stderr)
        return 1
    return 0


def run_specs(specs, host: str, port: int, *, concurrency: int, timeout: float, show: bool = False):
    """Play ``specs`` on a fresh uvloop event loop and return the RunOutcome."""
    import asyncio

    from .progress import show_progress
    from .runner import Progress, run_workload

    async def main():
        progress = Progress(total=len(specs))
        async with show_progress(progress, enabled=None if show else False):
            return await run_workload(specs, host, port, concurrency=concurrency, timeout=timeout, progress=progress)

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
