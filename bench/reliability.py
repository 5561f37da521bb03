#!/usr/bin/env python3
"""Hostile input and long runs against a gateway process in front of sim engines: one
figure per line for each part.

  slowloris    other clients' p99 with slow heads and silent connections open against it
               idle, the 408s and quiet closes they got, the gateway's fds before and after
  fuzz         --cases mutated request heads and --cases/10 JSON bodies: answers by status,
               hangs, 500s, the process alive, a valid request served after every 1,000 cases
  faults       load through a sim engine failing --fail-rate of its requests: outcomes, and
               whether velocity_requests_total and the lease counters reconcile with them
  soak         the capacity first (--connections closed-loop clients, 10 s), then --seconds
               at --load (80 %) of it, open loop over a pool of --connections, two sim engines
               failing 1 % of their requests: lost requests, counters reconciled, RSS and fd
               growth from minute 1 (a third of a shorter run; minute 3 too in a run of 6
               minutes or more) to the end, the RSS every 30 s
  reloads      SIGHUP with a good, two invalid and a good config again under load: failures

    python -m bench.reliability                   # the defaults: a few minutes
    python -m bench.reliability --cases 1000000 --jobs 8 --only fuzz
    python -m bench.reliability --smoke           # tiny counts: every figure, in seconds
    python -m bench.reliability --json out.json   # the figures as JSON too

The gateway runs with 1 s read timeouts (header, body, first byte) so that every
unfinished case settles quickly; everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import orjson

from bench.lib import hostile as h
from bench.lib.load import closed_loop as _closed_loop
from bench.lib.load import open_loop as _open_loop
from bench.lib.procfs import fds, rss_kib
from bench.lib.stack import Stack, gateway_stack

FIGURES: dict[str, float] = {}


def figure(name: str, value: float, note: str = "") -> None:
    FIGURES[name] = value
    v = f"{value:.3f}" if isinstance(value, float) and not value.is_integer() else f"{int(value)}"
    print(f"  {name:34s} {v:>12s}  {note}", flush=True)


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def wire(route: str, rng: random.Random, stream_share: float = 0.0) -> bytes:
    obj = orjson.loads(h.valid_body(route, max_tokens=rng.randint(2, 8)))
    if route != "/generate" and rng.random() < stream_share:
        obj["stream"] = True
    body = orjson.dumps(obj)
    return (
        f"POST {route} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def _make_wire(stream_share: float):
    """Each request: a route drawn from the client's random stream, then its body."""
    return lambda rng: wire(rng.choice(h.ROUTES), rng, stream_share)


async def closed_loop(
    port: int, clients: int, seconds: float, *, stream_share: float = 0.0, think: float = 0.0, seed: int = 0
) -> list:
    """``clients`` keep-alive clients, each sending its next request when the last is
    answered, for ``seconds``: every Result (status 0: no answer)."""
    return await _closed_loop(port, clients, seconds, _make_wire(stream_share), think=think, seed=seed)


async def open_loop(
    port: int,
    rate: float,
    seconds: float,
    *,
    seed: int = 0,
    stream_share: float = 0.2,
    connections: int = 64,
    on_tick=None,
) -> tuple[list, int]:
    """Requests at ``rate`` per second for ``seconds`` over a pool of at most ``connections``
    keep-alive connections: (every Result, with None for one that never finished, and the
    number sent)."""
    return await _open_loop(
        port, rate, seconds, _make_wire(stream_share), seed=seed, connections=connections, on_tick=on_tick
    )


def statuses(results) -> Counter:
    return Counter(0 if r is None else r.status for r in results)


# -- parts -----------------------------------------------------------------------------------------


async def slowloris(stack: Stack, slow: int, silent: int, seconds: float) -> None:
    pid = stack.pid
    idle = [r.done - r.sent for r in await closed_loop(stack.port, 8, seconds, seed=1) if r.status == 200]
    await asyncio.sleep(0.5)
    fds_before = fds(pid)  # after the idle run: the engine connections it pooled are counted in both
    got_408 = 0
    quiet = 0
    head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: " + b"a" * 4000

    async def slow_head() -> None:
        nonlocal got_408
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        try:
            for b in head:  # a byte every 0.2 s: never a whole head within the header timeout
                writer.write(bytes([b]))
                try:
                    data = await asyncio.wait_for(reader.read(65536), 0.2)
                except asyncio.TimeoutError:
                    continue
                if data.startswith(b"HTTP/1.1 408"):
                    got_408 += 1
                return
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def silent_conn() -> None:
        nonlocal quiet
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
        try:
            if await asyncio.wait_for(reader.read(), h.HANG_S) == b"":
                quiet += 1
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.transport.abort()

    attack = [asyncio.ensure_future(slow_head()) for _ in range(slow)] + [
        asyncio.ensure_future(silent_conn()) for _ in range(silent)
    ]
    await asyncio.sleep(0.2)
    during = [r.done - r.sent for r in await closed_loop(stack.port, 8, seconds, seed=2) if r.status == 200]
    await asyncio.wait(attack, timeout=h.HANG_S + 5)
    await asyncio.sleep(0.5)
    fds_after = fds(pid)
    figure("slowloris_p99_idle_ms", round(p99(idle) * 1000, 2))
    figure("slowloris_p99_attacked_ms", round(p99(during) * 1000, 2))
    figure("slowloris_p99_ratio", round(p99(during) / p99(idle), 3), "other clients' p99, attacked / idle")
    figure("slowloris_slow_heads", slow)
    figure("slowloris_408s", got_408, "slow heads answered 408")
    figure("slowloris_silent_conns", silent)
    figure("slowloris_silent_closed_quietly", quiet, "closed at the first-byte timeout, no answer")
    figure("slowloris_fds_before", fds_before)
    figure("slowloris_fds_after", fds_after)


def _fuzz_worker(args: tuple) -> dict:
    """One process's share of the fuzz cases (a seed of its own): its tally, as a dict."""
    port, kind, seed, count, batch = args
    tally = h.Tally()
    served_failed = 0

    async def main() -> None:
        nonlocal served_failed
        gen = h.head_cases(seed, count) if kind == "heads" else h.body_cases(seed, count)
        while True:
            chunk = [c for _, c in zip(range(batch), gen)]
            if not chunk:
                break
            await h.run_cases(port, chunk, tally, concurrency=48)
            if not await h.served(port):
                served_failed += 1

    asyncio.run(main())
    return {
        "statuses": dict(tally.statuses),
        "hangs": tally.hangs,
        "cases": tally.cases,
        "closed": tally.closed_without_answer,
        "served_failed": served_failed,
        "first_500s": [(repr(c)[:300], b.decode("latin-1")) for c, b in tally.five_hundreds],
    }


def fuzz(stack: Stack, kind: str, cases: int, jobs: int, seed: int) -> None:
    t0 = time.monotonic()
    jobs = max(1, min(jobs, cases))
    shares = [(stack.port, kind, seed * 100 + j, cases // jobs + (j < cases % jobs), 1000) for j in range(jobs)]
    if jobs == 1:
        parts = [_fuzz_worker(shares[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            parts = pool.map(_fuzz_worker, shares)
    st = Counter()
    for p in parts:
        st.update({int(k): v for k, v in p["statuses"].items()})
    n = sum(p["cases"] for p in parts)
    elapsed = time.monotonic() - t0
    figure(f"{kind}_cases", n, f"{n / elapsed:.0f} cases/s")
    for code in sorted(st):
        figure(f"{kind}_status_{code}", st[code])
    figure(f"{kind}_500s", st.get(500, 0))
    figure(f"{kind}_hangs", sum(p["hangs"] for p in parts))
    figure(f"{kind}_closed_without_answer", sum(p["closed"] for p in parts))
    figure(
        f"{kind}_served_checks_failed",
        sum(p["served_failed"] for p in parts),
        "valid requests not served after a batch of 1,000",
    )
    figure(f"{kind}_gateway_alive", int(stack.alive()))
    for p in parts:
        for case, body in p["first_500s"]:
            print(f"    500 for {case}: {body[:200]}")


async def faults(stack: Stack, clients: int, seconds: float, fail_rate: float) -> None:
    results = await closed_loop(stack.port, clients, seconds, stream_share=0.3, seed=3)
    await asyncio.sleep(0.5)
    m = await h.metrics(stack.admin_port)
    st = statuses(results)
    figure("faults_fail_rate", fail_rate, "the sim engine's --fail-rate")
    figure("faults_requests", len(results))
    for code in sorted(st):
        figure(f"faults_status_{code}", st[code])
    figure("faults_lost", st.get(0, 0), "no answer (a 500 above is the engine's own, relayed)")
    counted = h.total(m, "velocity_requests_total")
    figure("faults_requests_total_counted", counted)
    adm = h.total(m, "velocity_admitted_total")
    ended = sum(h.total(m, f"velocity_{k}_total") for k in ("completed", "failed", "cancelled"))
    figure("faults_admitted", adm)
    figure("faults_completed_failed_cancelled", ended)
    figure(
        "faults_counters_reconcile",
        int(counted == len(results) and adm == ended),
        "velocity_requests_total == requests answered, admitted == completed+failed+cancelled",
    )
    figure("faults_internal_errors", h.total(m, "velocity_internal_errors_total"))


async def capacity(port: int, clients: int, seconds: float) -> float:
    """Answers per second of ``clients`` closed-loop keep-alive clients (the soak's mix of
    routes and streams) for ``seconds``: what the gateway, the engines and this client
    process get through together on this machine."""
    t0 = time.monotonic()
    results = await closed_loop(port, clients, seconds, stream_share=0.2, seed=6)
    return sum(r.status != 0 for r in results) / (time.monotonic() - t0)


def _rss_growth(samples: list, since: float, end_kib: int) -> tuple[float, int]:
    """RSS growth in % from the first sample at or after ``since`` s to ``end_kib``, and
    that sample's time (the first sample when none is that late)."""
    t, rss = next(((t, r) for t, r, _ in samples if t >= since), samples[0][:2])
    return 100.0 * (end_kib - rss) / rss, int(t)


async def soak(stack: Stack, seconds: float, rate: float, load: float, connections: int, capacity_s: float) -> None:
    pid = stack.pid
    if not rate:
        cap = await capacity(stack.port, connections, capacity_s)
        rate = load * cap
        figure("soak_capacity_per_s", round(cap, 1), f"{connections} closed-loop clients for {capacity_s:.0f} s")
        await asyncio.sleep(1.0)
    m0 = await h.metrics(stack.admin_port)
    fds_before = fds(pid)
    samples = []  # (s into the run, RSS KiB, fds), every 5 s, under load

    def tick(t: float) -> None:
        samples.append((t, rss_kib(pid), fds(pid)))

    results, sent = await open_loop(stack.port, rate, seconds, seed=4, connections=connections, on_tick=tick)
    await asyncio.sleep(0.5)
    rss_end, fds_after = rss_kib(pid), fds(pid)
    if not samples:  # a run shorter than one tick
        samples.append((0.0, rss_end, fds_after))
    st = statuses(results)
    answered = sent - st.get(0, 0)
    m = await h.metrics(stack.admin_port)
    figure("soak_seconds", seconds)
    figure("soak_rate_per_s", round(rate, 1), f"{load:.0%} of capacity" if FIGURES.get("soak_capacity_per_s") else "")
    figure("soak_connections", connections, "the client's pool: at most this many requests in flight")
    figure("soak_requests", sent)
    figure("soak_ok", st.get(200, 0))
    figure("soak_engine_500s", st.get(500, 0), "the faulty engine's own 500s, relayed")
    figure("soak_lost", sent - answered, "sent - answered")
    # Growth from minute 1 (a third of a shorter run) to the end; from minute 3 too, when
    # the run is long enough for that to say something (past any warm-up).
    mark = min(60.0, seconds / 3)
    growth, at = _rss_growth(samples, mark, rss_end)
    rss_at = next(r for t, r, _ in samples if t >= at)
    figure("soak_rss_mib_at_mark", round(rss_at / 1024, 1), f"at {at} s")
    figure("soak_rss_mib_end", round(rss_end / 1024, 1))
    figure("soak_rss_growth_pct", round(growth, 2), f"from {at} s to the end")
    if seconds >= 360:
        growth3, at3 = _rss_growth(samples, 180.0, rss_end)
        figure("soak_rss_growth_from_3min_pct", round(growth3, 2), f"from {at3} s to the end")
    fds_mark = next(f for t, _, f in samples if t >= at)
    figure("soak_fd_growth", samples[-1][2] - fds_mark, f"under load, {at} s to the last sample")
    figure("soak_fds_after_vs_before", fds_after - fds_before, "the client's connections closed")
    # The first sample at or after each 30 s (a tick that a stalled loop ran late still counts).
    curve = [next(x for x in samples if x[0] >= k * 30 - 0.5) for k in range(1, int(samples[-1][0] + 0.5) // 30 + 1)]
    print("    RSS MiB every 30 s: " + " ".join(f"{int(round(t))}s:{r / 1024:.1f}" for t, r, _ in curve), flush=True)
    print("    fds every 30 s:     " + " ".join(f"{int(round(t))}s:{f}" for t, _, f in curve), flush=True)
    figure("soak_internal_errors", h.total(m, "velocity_internal_errors_total"))
    counted = h.total(m, "velocity_requests_total") - h.total(m0, "velocity_requests_total")
    figure("soak_requests_total_counted", counted, "velocity_requests_total during the soak")
    adm = h.total(m, "velocity_admitted_total")
    ended = sum(h.total(m, f"velocity_{k}_total") for k in ("completed", "failed", "cancelled"))
    figure(
        "soak_counters_reconcile",
        int(counted == answered and adm == ended),
        "counted == answered, admitted == completed+failed+cancelled",
    )


async def reloads(stack: Stack, seconds: float) -> None:
    good = Path(stack.config).read_text()
    changed = good.replace("keepalive_timeout_s: 5.0", "keepalive_timeout_s: 6.0") + "sla_ms: 2500.0\n"
    steps = [changed, "server: [this is: not valid\n", good + "no_such_key: 1\n", good]
    pid = stack.pid

    async def hups() -> None:
        for text in steps:
            await asyncio.sleep(seconds / (len(steps) + 1))
            Path(stack.config).write_text(text)
            os.kill(pid, signal.SIGHUP)
        await asyncio.sleep(0.5)

    load = asyncio.ensure_future(closed_loop(stack.port, 8, seconds, stream_share=0.3, seed=5))
    await hups()
    results = await load
    Path(stack.config).write_text(good)
    log = stack.log_text
    st = statuses(results)
    figure("reload_signals", len(steps), "good, invalid YAML, unknown key, good")
    figure("reload_applied", log.count("config reloaded"))
    figure("reload_refused", log.count("reload refused") + log.count("reload failed"))
    figure("reload_requests", len(results))
    figure(
        "reload_failed_requests",
        sum(v for k, v in st.items() if k == 0 or k >= 500),
        "no answer or 5xx during the reloads",
    )
    figure("reload_gateway_alive", int(stack.alive()))


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=20000, help="fuzzed heads (bodies: a tenth)")
    ap.add_argument("--jobs", type=int, default=1, help="client processes for the fuzz")
    ap.add_argument("--seconds", type=float, default=90.0, help="the soak's length")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="the soak's requests per second (default: --load times the capacity measured first)",
    )
    ap.add_argument("--load", type=float, default=0.8, help="the soak's rate as a share of the measured capacity")
    ap.add_argument(
        "--connections",
        type=int,
        default=64,
        help="the soak's client connections (and the capacity run's closed-loop clients)",
    )
    ap.add_argument("--fail-rate", type=float, default=0.05, help="the faulty sim engine's --fail-rate")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated parts: slowloris,fuzz,faults,soak,reloads")
    ap.add_argument("--smoke", action="store_true", help="tiny counts: every part in seconds")
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args(argv)
    slow, silent, attack_s, fault_s, reload_s, capacity_s = 200, 100, 5.0, 20.0, 10.0, 10.0
    if args.smoke:
        args.cases, args.seconds = 300, 4.0
        slow, silent, attack_s, fault_s, reload_s, capacity_s = 10, 5, 1.0, 2.0, 2.5, 1.0
    parts = [p for p in args.only.split(",") if p] or ["slowloris", "fuzz", "faults", "soak", "reloads"]
    t0 = time.monotonic()
    if "slowloris" in parts:
        print(f"slowloris: {slow} slow heads, {silent} silent connections, 8 other clients", flush=True)
        with gateway_stack() as stack:
            asyncio.run(slowloris(stack, slow, silent, attack_s))
    if "fuzz" in parts:
        print(f"fuzz: {args.cases} heads, {max(1, args.cases // 10)} bodies, seed {args.seed}", flush=True)
        with gateway_stack() as stack:
            fuzz(stack, "heads", args.cases, args.jobs, args.seed)
            fuzz(stack, "bodies", max(1, args.cases // 10), args.jobs, args.seed + 1)
            m = asyncio.run(h.metrics(stack.admin_port))
            figure("fuzz_internal_errors", h.total(m, "velocity_internal_errors_total"))
    if "faults" in parts:
        print(f"faults: sim engine --fail-rate {args.fail_rate}, 16 clients, {fault_s:.0f} s", flush=True)
        with gateway_stack("--fail-rate", str(args.fail_rate), engines=2) as stack:
            asyncio.run(faults(stack, 16, fault_s, args.fail_rate))
    if "soak" in parts:
        at = f"{args.rate:.0f} requests/s" if args.rate else f"{args.load:.0%} of the capacity measured first"
        print(f"soak: {args.seconds:.0f} s at {at}, {args.connections} connections, 1% engine faults", flush=True)
        with gateway_stack("--fail-rate", "0.01", engines=2) as stack:
            asyncio.run(soak(stack, args.seconds, args.rate, args.load, args.connections, capacity_s))
    if "reloads" in parts:
        print(f"reloads: 4 SIGHUPs under load, {reload_s:.0f} s", flush=True)
        with gateway_stack(log_level="info") as stack:
            asyncio.run(reloads(stack, reload_s))
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(FIGURES, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
