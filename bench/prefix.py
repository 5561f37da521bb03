"""Prefix-affinity gain: TTFT and engine prefix-cache hit rate, chat against the other profiles.

The same seeded shared-prefix workload (by default 16 groups, each a long shared
context followed by a varied question; streamed, so TTFT is measured) is sent through
the gateway to 4 fresh sim engines once per routing profile:

- ``chat``: prefix affinity balanced against load, hot-spot guard;
- ``batch``: shortest queue (engine waiting + gateway in flight);
- ``round-robin``: endpoints in turn, the classic baseline;
- ``least-loaded``: fewest gateway in-flight requests (least connections), the other one.

Each variant gets new engines (empty caches) and the gateway in this process, configured
as a user would: ``models: {sim-model: {profile: VARIANT}}``. The hit rate is the engines' own:
sum of ``vllm:prefix_cache_hits_total`` / sum of ``vllm:prefix_cache_queries_total``
scraped from each engine after the run. The engines' KV cache is sized so that one
engine cannot keep every group's context (the regime where routing matters).

    python -m bench.prefix                       # prints the table, writes nothing
    python -m bench.prefix --output bench/results/prefix.json
    python -m bench.prefix --smoke               # tiny counts: every variant runs, figures not meaningful

Targets: chat's engine hit rate >= 2x batch's; chat's TTFT p50 >= 3x better than
round-robin's.

Scenarios of precise prefix routing (``--scenario``; docs/kv-events.md), each on the same
seeded traffic for ``precise`` (chat, `prefix: precise`: the engines' KV events),
``approximate`` (chat, the gateway's own index), ``round-robin`` and ``least-loaded``;
the engines publish their KV events and tokenize with a tokenizer built here from the
workload's words (the ``tokenizers`` package), for every variant alike:

- ``restart``: engine 0 is stopped halfway through the run and started again 4 s later
  (``--restart-down-s``; 16 s of engine time) with an empty cache, on the fleet of
  ``replicas`` (``RESTART``). While it is down its groups move to the others; a gateway
  that only remembers where it sent prompts then sends them back to the restarted engine
  too (it still believes that engine holds them, and it is the emptiest), so they are
  held twice and push others out;
- ``replicas``: two gateways in front of the same engines, each taking every other
  request (each sees only half the traffic). Its defaults (``REPLICAS``) size the fleet
  for its traffic, as one sizes a real one: 288 KV blocks an engine, so the four hold the
  16 groups' contexts once with about 12% to spare. Two approximate replicas that place a
  group on different engines hold it twice and evict the others; each still believes its
  own placements. 640 requests, so the run is long past the cold start. Two more
  variants, ``precise-1`` and ``approximate-1``, send the same traffic through one gateway
  on the same fleet (configured as each replica is; its client's ``--concurrency`` is one
  replica's, which at 40 requests/s never binds): the reference for the replicas' engine
  hit rate. The scenario prints, per mode, the two replicas' hit rate over one
  gateway's, and writes it (``replicas_vs_one_gateway`` in the JSON).

- ``tenants``: many tenants (64 groups), each with its long system prompt, and engines
  whose KV cache holds only a few of them (256 blocks): the working set is past the
  fleet's cache, so what each engine still holds changes all the time.

    python -m bench.prefix --scenario restart
    python -m bench.prefix --scenario replicas
    python -m bench.prefix --scenario tenants

Goal: precise at least 2x better TTFT p90 than approximate in restart and
replicas, and no worse in tenants. Goal: two precise replicas' engine hit rate
within 5% of one precise gateway's (ratio >= 0.95); measured 0.972-0.981 (bench/README.md).

Scenario ``hot``: one prefix carries half the traffic (``--hot-share``), the rest spread
over the other groups. Variants:

- ``chat`` as configured by default: the hot-spot guard spills a request once its
  affinity pick's engine queues ``hotspot_waiting`` requests, to the best engine that
  does not; the index then holds the prefix on both, so it stays spread;
- ``gap``: the same with the guard on the load gap alone (``hotspot_gap``: engine
  waiting + gateway in flight, running requests included), the rule before the engine
  queue was read;
- ``affinity``: pure prefix affinity, as a cache-aware router without load terms: no
  guard, no load weight, no saturation filter;
- round-robin and least-loaded.

Its defaults (``HOT``) put the hot prefix's demand past what one engine runs while the
whole load is about two thirds of the fleet's: 11 requests/s of engine time (22.5/s at
time scale 2), 128 tokens out, engines of 12 sequences, with KV for every group's
context (1,024 blocks), so that the hot prefix, not the cache, is what is measured:

    python -m bench.prefix --scenario hot

Goal: chat's TTFT p99 at least 2x better than affinity's, with a hit rate at
least 0.9x of affinity's.

Scenario ``hot-admission``: the same question with the gateway at its defaults
(dynamic admission, its SLA, concurrency bound and scrape interval, no ``models:``
section: the default profile). One prefix carries half of 20 requests/s (Poisson, real
time, 960 requests), twelve others the rest; four engines of 8 sequences, 32 tokens out
(``HOT_ADMISSION``).
Variants ``chat`` (the defaults) and ``affinity`` (pure affinity, as above); end-to-end
latency, the engines' hit rate, where group 0 (the hot prefix) went, and, sampled every
50 ms, the gateway's queue and each engine's in-flight, running and waiting:

    python -m bench.prefix --scenario hot-admission --repeats 5

Pure affinity here never spills (``routing.spill: false``): the engine holding the prefix
takes the request even at its limit. Goal: chat's latency p95, over the requests that
arrive after ``--warmup-s`` (8 s: each context's first prefill), at least 1.5x better than
affinity's in every run, with a hit rate at least 0.9x of affinity's (bench/README.md has
the runs).

Scenario ``hot-open``: the same question as a user meets it, with arrivals the scenario
does not tune and nothing left out. Fresh engines and a gateway at its defaults; Poisson
arrivals at 24 requests/s of engine time (``--rate`` is in engine time here), 480
requests; the same engines, prefixes and variants as hot-admission; every request counts,
from the first second (each context's first prefill and the batch admission has yet to
learn are in the run). ``--time-scale`` runs the same traffic faster: the gateway's SLA
and scrape interval are scaled with it (``HOT_OPEN``):

    python -m bench.prefix --scenario hot-open --repeats 5

Goal: chat's latency p95 at least 1.5x better than pure affinity's in at least four runs
of five, and no request of chat declined (the fleet serves this traffic).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.lib.engines import MODEL, Engines, engine_hits
from velocity_fast.config import EndpointConfig, KVEventsConfig, load_settings
from velocity_fast.gateway.app import Gateway
from velocity_fast.loadgen.mix import PLAIN_CLIENTS, Dist, Mix, Prefix
from velocity_fast.loadgen.report import write_json
from velocity_fast.loadgen.runner import run_workload
from velocity_fast.loadgen.stats import percentile, summarize
from velocity_fast.loadgen.workload import WorkloadConfig, build_workload

VARIANTS = ("chat", "batch", "round-robin", "least-loaded")
PRECISE_VARIANTS = ("precise", "approximate", "round-robin", "least-loaded")
# Scenario replicas: the same modes through one gateway that takes every request, the
# reference the two replicas are held to (the goal: precise replicas within 5% of its
# engine hit rate).
REPLICAS_VARIANTS = ("precise", "precise-1", "approximate", "approximate-1", "round-robin", "least-loaded")
ONE_GATEWAY = "-1"  # a variant's suffix: one gateway, in scenario replicas
# The goal: two precise replicas' engine hit rate at least this share of one gateway's.
REPLICAS_HIT_GOAL = 0.95
SCENARIOS = ("shared", "restart", "replicas", "tenants", "hot", "hot-admission", "hot-open")
# The precise scenarios: the engines publish KV events and tokenize.
PRECISE_SCENARIOS = ("restart", "replicas", "tenants")
# Scenario tenants: many tenants, each with its long system prompt, and a KV cache per
# engine that holds a few of them (defaults where the command line does not say).
TENANTS = {"groups": 64, "num_gpu_blocks": 256}
# Scenario replicas: a fleet whose KV cache holds the working set once, little more.
REPLICAS = {"requests": 640, "num_gpu_blocks": 288}
# Scenario restart: the same fleet, and engine 0 down 4 s (16 s of engine time: a vLLM
# engine takes tens of seconds to load its weights again) before it comes back empty.
RESTART = {"requests": 640, "num_gpu_blocks": 288, "restart_down_s": 4.0}
# Scenario hot: engines that run 12 sequences at once (vLLM's --max-num-seqs) and replies
# of 128 tokens, so that the hot prefix's demand (half the traffic) is past what one
# engine runs while the whole load is about two thirds of the fleet's.
HOT = {
    "rate": 22.5,
    "time_scale": 2.0,
    "requests": 480,
    "output_tokens": 128,
    "max_num_seqs": 12,
    "num_gpu_blocks": 1024,
}
# One hot prefix: the router's spreading (chat, as configured by default) against the
# load-gap guard alone and against pure affinity (no load term of any kind).
HOT_VARIANTS = ("chat", "gap", "affinity", "round-robin", "least-loaded")
PURE_AFFINITY = {
    "hotspot_gap": 1e9,
    "hotspot_waiting": 1e9,
    "load_weight": 0.0,
    "spill": False,
    "saturation_waiting": 1e9,
    "saturation_kv": 1.0,
}
GAP_GUARD = {"hotspot_waiting": 0.0}  # 0: the engine queue is not read
# Scenario hot-admission: the gateway at its defaults (dynamic admission, its SLA, no
# models: section), one prefix carrying half of 20 requests/s over 13 groups, engines of
# 8 sequences, 32 tokens out, in real time: the hot prefix's demand is about 85 % of one
# engine's, so under pure affinity its backlog waits in admission's queue. 960 requests
# (48 s): at 85 % busy the hot engine's queue comes and goes over tens of seconds, and a
# 16 s window after the warm-up did not always hold one such swing (bench/README.md).
HOT_ADMISSION = {
    "rate": 20.0,
    "time_scale": 1.0,
    "requests": 960,
    "output_tokens": 32,
    "max_num_seqs": 8,
    "num_gpu_blocks": 1024,
    "groups": 13,
    "concurrency": 1024,
    "warmup_s": 8.0,
}
HOT_ADMISSION_VARIANTS = ("chat", "affinity")
# Scenario hot-open: the same question as a user meets it. Poisson arrivals the scenario
# does not tune, judged from the first second (no warm-up left out): fresh engines, each
# context's first prefill and the batch admission has yet to learn are part of the run.
# 24 requests/s of engine time (the hot prefix past what one engine of 8 serves, the
# fleet at about three quarters), 480 requests; the gateway's SLA and scrape interval are
# scaled with --time-scale, so that a scaled run is the same run, faster (tests/bench/).
HOT_OPEN = {
    "rate": 24.0,
    "time_scale": 1.0,
    "requests": 480,
    "output_tokens": 32,
    "max_num_seqs": 8,
    "num_gpu_blocks": 1024,
    "groups": 13,
    "concurrency": 1024,
    "warmup_s": 0.0,
}
# Its goal: chat's latency p95 at least this much better than pure affinity's in at least
# HOT_OPEN_RUNS of every 5 runs, and no request of chat declined.
HOT_OPEN_GOAL = 1.5
HOT_OPEN_RUNS = 4
# The gateway's defaults the scenario scales with the engines' time (engine-time values).
SLA_MS = 3000.0
SCRAPE_MS = 100.0
# --smoke: every variant and phase at a size that runs in seconds (CI: tests/bench/).
SMOKE = {"engines": 2, "requests": 24, "rate": 60.0, "groups": 4, "prefix_tokens": 256, "time_scale": 20.0}


async def _sample(gw, out: list, every_s: float = 0.05) -> None:
    """Every ``every_s``: the gateway's queue (admission, all bands) and, per endpoint, what
    it has in flight there and the engine's last gauges (waiting, running)."""
    while True:
        eps = {ep.name: (ep.inflight, ep.waiting, ep.running) for ep in gw.endpoints.values()}
        out.append((gw.admission.queued(), eps))
        await asyncio.sleep(every_s)


def _load_summary(samples: list) -> dict:
    """Means over the run's samples: the gateway's queue, the share of samples with one,
    and per endpoint its in-flight, waiting and running, and the most waiting seen."""
    if not samples:
        return {}
    n = len(samples)
    out = {
        "gateway_queued_mean": round(sum(q for q, _ in samples) / n, 2),
        "gateway_queued_share": round(sum(q > 0 for q, _ in samples) / n, 3),
        "endpoints": {},
    }
    for name in samples[0][1]:
        rows = [eps[name] for _, eps in samples if name in eps]
        out["endpoints"][name] = {
            "inflight": round(sum(r[0] for r in rows) / len(rows), 2),
            "waiting": round(sum(r[1] for r in rows) / len(rows), 2),
            "running": round(sum(r[2] for r in rows) / len(rows), 2),
            "waiting_max": max(r[1] for r in rows),
        }
    return out


def _admission_summary(gw) -> dict:
    s = gw.admission.stats()
    return {
        "rejections": s["rejections"],
        "limits": s["limits"],
        "sla": s["sla"],
        "batch_capacity": {k: e["batch_capacity"] for k, e in s["endpoints"].items()},
    }


def _model_config(variant: str) -> dict:
    """The `models:` entry of a variant: a profile, or chat with a prefix mode."""
    variant = variant.removesuffix(ONE_GATEWAY)
    if variant in ("precise", "approximate"):
        return {"profile": "chat", "prefix": variant}
    if variant in ("affinity", "gap"):
        return {"profile": "chat"}  # (and PURE_AFFINITY or GAP_GUARD in `routing:`)
    return {"profile": variant}


def bench_tokenizer(folder: str) -> str:
    """A word-level tokenizer.json over the workload's words, with ChatML's markers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from velocity_fast.loadgen.workload import WORDS

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"])
    )
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


async def run_variant(variant: str, args, specs) -> dict:
    scenario = getattr(args, "scenario", "shared")
    kv_dir = tempfile.mkdtemp(prefix="velocity-prefix-bench-") if scenario in PRECISE_SCENARIOS else None
    flags = [
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--time-scale",
        str(args.time_scale),
        "--prefill-tps",
        str(args.prefill_tps),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
    ]
    tokenizer = bench_tokenizer(kv_dir) if kv_dir else None
    if tokenizer:
        flags += ["--tokenizer", tokenizer]
    engines = Engines(args.engines, flags, kv_dir)
    gws: list = []
    try:
        await asyncio.to_thread(engines.start)
        eps = []
        for i, p in enumerate(engines.ports):
            kv = engines.kv_events(i)
            events = KVEventsConfig(endpoint=kv[0], replay_endpoint=kv[1], topic="kv") if kv else None
            eps.append(EndpointConfig(name=f"e{i}", url=f"http://127.0.0.1:{p}", model=MODEL, kv_events=events))
        routing = {"seed": args.seed}
        if variant == "affinity":
            routing.update(PURE_AFFINITY)
        elif variant == "gap":
            routing.update(GAP_GUARD)
        if tokenizer:
            routing["tokenizer"] = tokenizer
        keys = {
            "host": "127.0.0.1",
            "port": 0,
            "admin_port": 0,
            "endpoints": eps,
            "routing": routing,
            "health": {"scrape_interval_ms": 50.0},
        }
        if scenario == "hot-open":
            # The gateway's defaults, its SLA and scrape interval in the engines' time.
            keys["health"] = {"scrape_interval_ms": SCRAPE_MS / args.time_scale}
            keys["sla_ms"] = SLA_MS / args.time_scale
        elif scenario == "hot-admission":
            # The gateway's defaults: admission, its SLA and concurrency bound, its scrape
            # interval, and the default profile (chat) for a model not listed; a load-only
            # baseline by profile.
            del keys["health"]
            if variant not in ("chat", "affinity"):
                keys["models"] = {MODEL: _model_config(variant)}
        else:
            keys.update(
                {"policy": "static", "max_concurrency": args.concurrency, "models": {MODEL: _model_config(variant)}}
            )
        settings = load_settings(None, keys, env={})
        replicas = 2 if scenario == "replicas" and not variant.endswith(ONE_GATEWAY) else 1
        for _ in range(replicas):
            gw = Gateway(settings)
            gws.append(gw)
            await gw.start("127.0.0.1", 0, 0)
        deadline = time.monotonic() + 15
        while not all(ep.healthy and ep.num_gpu_blocks for gw in gws for ep in gw.endpoints.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("engines did not turn healthy with their cache config scraped")
            await asyncio.sleep(0.05)
        restart = None
        if scenario == "restart":

            async def restart_halfway() -> None:
                await asyncio.sleep(args.requests / args.rate / 2)
                await asyncio.to_thread(engines.restart, 0, 30.0, args.restart_down_s)

            restart = asyncio.create_task(restart_halfway())
        # Replicas take every other request (arrival times kept: the same traffic in all).
        parts = [
            [dataclasses.replace(sp, index=j) for j, sp in enumerate(specs[k :: len(gws)])] for k in range(len(gws))
        ]
        samples: list = []
        sampler = asyncio.create_task(_sample(gws[0], samples))
        try:
            outcomes = await asyncio.gather(
                *(
                    run_workload(part, "127.0.0.1", gw.client_server.port, concurrency=args.concurrency, timeout=120.0)
                    for part, gw in zip(parts, gws)
                )
            )
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        if restart is not None:
            await restart
        hits, queries = await engine_hits(engines.ports)
        all_specs = [sp for part in parts for sp in part]
        results = [r for o in outcomes for r in o.results]
        start = min(o.start for o in outcomes)
        summary = summarize(all_specs, results, start=start, cpu_seconds=sum(o.cpu_seconds for o in outcomes))
        spread = {}
        hot_spread = {}  # where the requests of group 0 (the hot prefix, in scenario hot) went
        for sp, r in zip(all_specs, results):
            spread[r.endpoint] = spread.get(r.endpoint, 0) + 1
            if sp.prefix_group == 0:
                hot_spread[r.endpoint] = hot_spread.get(r.endpoint, 0) + 1
        latencies = sorted((r.done - r.sent) * 1000.0 for r in results if r.ok)
        # After the warm-up (--warmup-s of arrivals): each context's first prefill, which no
        # router avoids, and the limits admission learns at start are behind.
        warm = sorted(
            (r.done - r.sent) * 1000.0 for sp, r in zip(all_specs, results) if r.ok and sp.at >= args.warmup_s
        )
        # Each completed request's TTFT (wall ms): --repeats pools them over the runs.
        ttfts = sorted((r.first_token - r.sent) * 1000.0 for r in results if r.ok and r.first_token is not None)
        out = {
            "variant": variant,
            "scenario": scenario,
            "gateways": len(gws),
            "summary": summary,
            "ttft_samples_ms": ttfts,
            "engine_hit_rate": hits / queries if queries else 0.0,
            "engine_hits_tokens": hits,
            "engine_queries_tokens": queries,
            "requests_per_endpoint": dict(sorted(spread.items())),
            "group0_per_endpoint": dict(sorted(hot_spread.items())),
            "latency_samples_ms": latencies,
            "latency_warm_samples_ms": warm,
            "latency_warm_ms": {p: _pooled(warm, p) if warm else 0.0 for p in ("p50", "p95", "p99")},
            "load": _load_summary(samples),
            "router": gws[0].router.stats(),
            "admission": _admission_summary(gws[0]),
        }
        if scenario in ("hot-admission", "hot-open"):
            # Each request: arrival s, group, endpoint, latency and TTFT ms, status.
            out["requests"] = [
                (
                    round(sp.at, 3),
                    sp.prefix_group,
                    r.endpoint,
                    round((r.done - r.sent) * 1000.0, 1),
                    round((r.first_token - r.sent) * 1000.0, 1) if r.first_token is not None else None,
                    r.status,
                )
                for sp, r in zip(all_specs, results)
            ]
            # What was declined, by the fifth of the run it arrived in (a cold start's 429s
            # are in the first).
            span = max((sp.at for sp in all_specs), default=0.0) or 1.0
            fifths = [0] * 5
            for sp, r in zip(all_specs, results):
                if not r.ok:
                    fifths[min(4, int(5 * sp.at / span))] += 1
            out["not_ok_by_fifth"] = fifths
        if variant.removesuffix(ONE_GATEWAY) == "precise":
            out["precise_share"] = [gw.kv.precise.precise_share() for gw in gws if gw.kv.precise is not None]
        return out
    finally:
        for gw in gws:
            with contextlib.suppress(Exception):
                await gw.stop(grace=1.0)
        await asyncio.to_thread(engines.stop)
        if kv_dir is not None:
            shutil.rmtree(kv_dir, ignore_errors=True)


# Per scenario, the goal's figure: (baseline variant, variant, TTFT percentile, goal).
GOALS = {
    "restart": ("approximate", "precise", "p90", 2.0),
    "replicas": ("approximate", "precise", "p90", 2.0),
    "tenants": ("approximate", "precise", "p90", 1.0),
    "hot": ("affinity", "chat", "p99", 2.0),
}


async def main_async(args) -> int:
    if args.repeats <= 1:
        return (await run_once(args))[0]
    runs: list[list[dict]] = []
    code = 0
    for k in range(args.repeats):
        one = argparse.Namespace(**{**vars(args), "seed": args.seed + k, "output": None})
        print(f"-- run {k + 1} of {args.repeats}, seed {one.seed}", flush=True)
        c, rows = await run_once(one)
        code = code or c
        runs.append(rows)
    extra = _report_repeats(args, runs)
    if args.output:
        write_json(args.output, {"args": vars(args), "repeats": runs, **extra})
    return code


def _pooled(samples: list[float], p: str) -> float:
    return percentile(sorted(samples), float(p[1:]))


def _report_repeats(args, runs: list[list[dict]]) -> dict:
    """The runs side by side: each variant's TTFT percentiles over all runs' requests
    pooled (engine time), its hit rate's mean, and the goal's figure run by run, its
    median and pooled. One run's p90 or p99 rests on a few dozen requests; pooled, on
    repeats times as many. Returns the scenario's figures run by run, for the JSON."""
    variants = [r["variant"] for r in runs[0]]
    lines = [
        f"prefix bench, scenario {args.scenario}, {len(runs)} runs (seeds {args.seed}-"
        f"{args.seed + len(runs) - 1}), all requests pooled (TTFT in engine time):"
    ]
    pooled: dict[str, dict[str, float]] = {}
    for v in variants:
        rows = [r for run in runs for r in run if r["variant"] == v]
        samples = [x * args.time_scale for r in rows for x in r["ttft_samples_ms"]]
        pooled[v] = {p: _pooled(samples, p) for p in ("p50", "p90", "p99")}
        hit = sum(r["engine_hit_rate"] for r in rows) / len(rows)
        lines.append(
            f"  {v:<13} TTFT p50 {pooled[v]['p50']:8.0f} ms  p90 {pooled[v]['p90']:8.0f} ms  "
            f"p99 {pooled[v]['p99']:8.0f} ms  engine hit rate {100 * hit:5.1f}% (mean)  "
            f"requests {len(samples)}"
        )
    if args.scenario == "hot-admission":
        per = [_hot_admission_ratios({r["variant"]: r for r in run}) for run in runs]
        per = [x for x in per if x is not None]
        if per:
            lat = {
                v: _pooled(
                    [
                        x * args.time_scale
                        for r in runs
                        for row in r
                        if row["variant"] == v
                        for x in row["latency_warm_samples_ms"]
                    ],
                    "p95",
                )
                for v in ("chat", "affinity")
            }
            every = all(p >= 1.5 and h >= 0.9 for p, h in per)
            lines.append(
                f"  latency p95 after the first {args.warmup_s:g} s, affinity/chat: runs {', '.join(f'{p:.2f}x' for p, _ in per)}; "
                f"pooled {lat['affinity'] / lat['chat']:.2f}x (goal >= 1.5x in every run)"
            )
            lines.append(
                f"  hit rate chat/affinity: runs {', '.join(f'{h:.2f}x' for _, h in per)} "
                f"(goal >= 0.9x); goal {'met' if every else 'NOT met'} in every run: {every}"
            )
    if args.scenario == "hot-open":
        verdict = [hot_open_verdict({r["variant"]: r for r in run}) for run in runs]
        met = sum(v["met"] for v in verdict)
        need = math.ceil(HOT_OPEN_RUNS / 5 * len(runs))
        lines.append(
            f"  latency p95 from the first second, affinity/chat: runs "
            f"{', '.join(format(v['ratio'], '.2f') + 'x' for v in verdict)}; chat declined "
            f"{', '.join(str(v['chat_declined']) for v in verdict)}; affinity declined "
            f"{', '.join(str(v['affinity_declined']) for v in verdict)} (goal: >= {HOT_OPEN_GOAL:g}x "
            f"and none declined in {need} of {len(runs)}): {'met' if met >= need else 'NOT met'} "
            f"({met} of {len(runs)})"
        )
    goal = GOALS.get(args.scenario)
    if goal and goal[0] in pooled and goal[1] in pooled and pooled[goal[1]][goal[2]] > 0:
        base, v, p, want = goal
        per_run = []
        for run in runs:
            by = {r["variant"]: r for r in run}
            if base in by and v in by and by[v]["ttft_ms_engine_time"][p] > 0:
                per_run.append(by[base]["ttft_ms_engine_time"][p] / by[v]["ttft_ms_engine_time"][p])
        median = statistics.median(per_run) if per_run else math.nan
        lines.append(
            f"  TTFT {p} {base}/{v}: runs {', '.join(f'{x:.2f}x' for x in per_run)}; median {median:.2f}x; "
            f"pooled {pooled[base][p] / pooled[v][p]:.2f}x (goal >= {want:g}x)"
        )
    extra = {}
    if args.scenario == "replicas":
        per = [replicas_vs_one_gateway({r["variant"]: r for r in run}) for run in runs]
        extra["replicas_vs_one_gateway"] = per
        for mode in ("precise", "approximate"):
            ratios = [x[mode]["ratio"] for x in per if mode in x]
            if ratios:
                lines.append(
                    f"  engine hit rate, two {mode} replicas / one {mode} gateway: runs "
                    f"{', '.join(f'{x:.3f}' for x in ratios)}; mean {statistics.fmean(ratios):.3f}"
                )
        met = [x["met"] for x in per if "met" in x]
        if met:
            lines.append(
                f"  goal: two precise replicas within {100 * (1 - REPLICAS_HIT_GOAL):.0f}% of one "
                f"gateway's hit rate: {'met' if all(met) else 'NOT met'} in every run "
                f"({sum(met)} of {len(met)})"
            )
    print("\n".join(lines), flush=True)
    return extra


async def run_once(args) -> tuple[int, list[dict]]:
    """One workload (args.seed), every variant on it; the exit code and the rows."""
    hot = args.hot_share if args.scenario in ("hot", "hot-admission", "hot-open") else 0.0
    mix = Mix(
        prompt_tokens=Dist(value=args.suffix_tokens),
        output_tokens=Dist(value=args.output_tokens),
        prefix=Prefix(groups=args.groups, tokens=args.prefix_tokens, share=1.0, hot=hot),
        stream_share=1.0,
        clients=PLAIN_CLIENTS,
    )  # routing is measured on seeded lengths
    # hot-open's rate is in the engines' time, so that --time-scale runs the same traffic faster.
    rate = args.rate * args.time_scale if args.scenario == "hot-open" else args.rate
    cfg = WorkloadConfig(
        num_requests=args.requests,
        pattern="poisson",
        duration=args.requests / rate,
        seed=args.seed,
        route="chat",
        model=MODEL,
    )
    specs = build_workload(cfg, mix)
    rows = []
    variants = args.variants or ",".join(
        VARIANTS
        if args.scenario == "shared"
        else HOT_VARIANTS
        if args.scenario == "hot"
        else HOT_ADMISSION_VARIANTS
        if args.scenario in ("hot-admission", "hot-open")
        else REPLICAS_VARIANTS
        if args.scenario == "replicas"
        else PRECISE_VARIANTS
    )
    for variant in variants.split(","):
        res = await run_variant(variant, args, specs)
        s = res["summary"]
        # TTFT is scaled back to engine time: the sims run time_scale times faster.
        res["ttft_ms_engine_time"] = {
            k: v * args.time_scale for k, v in s["ttft_ms"].items() if isinstance(v, (int, float))
        }
        res["latency_ms_engine_time"] = {
            k: v * args.time_scale for k, v in s["latency_ms"].items() if isinstance(v, (int, float))
        }
        rows.append(res)
        share = f"  precise share {res['precise_share']}" if "precise_share" in res else ""
        print(
            f"{variant:<13} completed {s['completed']}/{s['requests']}  TTFT p50 "
            f"{res['ttft_ms_engine_time']['p50']:.0f} ms  p90 {res['ttft_ms_engine_time']['p90']:.0f} ms  "
            f"p99 {res['ttft_ms_engine_time']['p99']:.0f} ms  {s['throughput_rps']:.1f} req/s  "
            f"engine hit rate {100 * res['engine_hit_rate']:.1f}%  per endpoint {res['requests_per_endpoint']}" + share,
            flush=True,
        )
    if args.scenario == "hot":
        return _report_hot(args, rows), rows
    if args.scenario in ("hot-admission", "hot-open"):
        return _report_hot_admission(args, rows), rows
    if args.scenario == "tenants":
        return _report_tenants(args, rows), rows
    if args.scenario != "shared":
        return _report_precise(args, rows), rows
    by = {r["variant"]: r for r in rows}
    lines = [
        f"prefix bench: {args.requests} streamed chat requests, {args.groups} groups x "
        f"{args.prefix_tokens}-token shared context + {args.suffix_tokens}-token question, "
        f"{args.engines} sim engines x {args.num_gpu_blocks} KV blocks, time scale {args.time_scale} "
        "(TTFT in engine time)"
    ]
    for r in rows:
        t = r["ttft_ms_engine_time"]
        lines.append(
            f"  {r['variant']:<12} TTFT p50 {t['p50']:8.0f} ms  p99 {t['p99']:8.0f} ms  "
            f"engine prefix-cache hit rate {100 * r['engine_hit_rate']:5.1f}%  "
            f"completed {r['summary']['completed']}/{r['summary']['requests']}"
        )
    verdict = []
    if "chat" in by and "batch" in by and by["batch"]["engine_hit_rate"] > 0:
        verdict.append(
            f"hit rate chat/batch {by['chat']['engine_hit_rate'] / by['batch']['engine_hit_rate']:.2f}x (target >= 2x)"
        )
    for base, target in (("round-robin", " (target >= 3x)"), ("least-loaded", "")):
        if "chat" in by and base in by and by["chat"]["ttft_ms_engine_time"]["p50"] > 0:
            verdict.append(
                f"TTFT p50 {base}/chat {by[base]['ttft_ms_engine_time']['p50'] / by['chat']['ttft_ms_engine_time']['p50']:.2f}x"
                + target
            )
    lines.append("  " + "; ".join(verdict))
    print("\n".join(lines))
    if args.output:
        write_json(args.output, {"args": vars(args), "runs": rows})
    return (0 if all(r["summary"]["completed"] == r["summary"]["requests"] for r in rows) else 1), rows


def replicas_vs_one_gateway(by: dict) -> dict:
    """Per mode run both ways (``precise`` and ``precise-1``, ``approximate`` and
    ``approximate-1``): the engines' hit rate behind two replicas, behind one gateway, and
    the ratio; for precise, whether it meets the goal (``REPLICAS_HIT_GOAL``)."""
    out = {}
    for mode in ("precise", "approximate"):
        two, one = by.get(mode), by.get(mode + ONE_GATEWAY)
        if two is None or one is None:
            continue
        ratio = two["engine_hit_rate"] / one["engine_hit_rate"] if one["engine_hit_rate"] else 0.0
        out[mode] = {"two_replicas": two["engine_hit_rate"], "one_gateway": one["engine_hit_rate"], "ratio": ratio}
    if "precise" in out:
        out["goal"] = REPLICAS_HIT_GOAL
        out["met"] = out["precise"]["ratio"] >= REPLICAS_HIT_GOAL
    return out


def _replicas_lines(ratios: dict) -> list[str]:
    lines = [
        f"  engine hit rate, two {mode} replicas / one {mode} gateway: {100 * r['two_replicas']:.1f}% / "
        f"{100 * r['one_gateway']:.1f}% = {r['ratio']:.3f}"
        for mode, r in ratios.items()
        if mode in ("precise", "approximate")
    ]
    if "met" in ratios:
        lines.append(
            f"  goal: two precise replicas within {100 * (1 - REPLICAS_HIT_GOAL):.0f}% of one "
            f"gateway's hit rate: {'met' if ratios['met'] else 'NOT met'}"
        )
    return lines


def _report_precise(args, rows: list[dict]) -> int:
    by = {r["variant"]: r for r in rows}
    what = {
        "restart": f"engine 0 down {args.restart_down_s:g} s halfway, then back empty",
        "replicas": "two gateway replicas, every other request each; variants -1: one gateway, every request",
    }
    verdict = []
    if "precise" in by and "approximate" in by and by["precise"]["ttft_ms_engine_time"]["p90"] > 0:
        ratio = by["approximate"]["ttft_ms_engine_time"]["p90"] / by["precise"]["ttft_ms_engine_time"]["p90"]
        verdict.append(f"  TTFT p90 approximate/precise {ratio:.2f}x (goal >= 2x)")
    extra = {}
    if args.scenario == "replicas":
        extra["replicas_vs_one_gateway"] = ratios = replicas_vs_one_gateway(by)
        verdict += _replicas_lines(ratios)
    return _report(args, rows, f"scenario {args.scenario} ({what[args.scenario]})", verdict, extra)


def _report_tenants(args, rows: list[dict]) -> int:
    by = {r["variant"]: r for r in rows}
    verdict = []
    if "precise" in by and "approximate" in by and by["precise"]["ttft_ms_engine_time"]["p90"] > 0:
        ratio = by["approximate"]["ttft_ms_engine_time"]["p90"] / by["precise"]["ttft_ms_engine_time"]["p90"]
        verdict.append(f"  TTFT p90 approximate/precise {ratio:.2f}x (goal: precise no worse, >= 1x)")
    return _report(
        args,
        rows,
        f"scenario tenants ({args.groups} tenants' system prompts, a KV cache of "
        f"{args.num_gpu_blocks} blocks an engine)",
        verdict,
    )


def _report_hot(args, rows: list[dict]) -> int:
    by = {r["variant"]: r for r in rows}
    verdict = []
    if "chat" in by and "affinity" in by and by["chat"]["ttft_ms_engine_time"]["p99"] > 0:
        p99 = by["affinity"]["ttft_ms_engine_time"]["p99"] / by["chat"]["ttft_ms_engine_time"]["p99"]
        hit = (
            by["chat"]["engine_hit_rate"] / by["affinity"]["engine_hit_rate"]
            if by["affinity"]["engine_hit_rate"]
            else 0.0
        )
        if "gap" in by and by["chat"]["ttft_ms_engine_time"]["p99"] > 0:
            verdict.append(
                f"  TTFT p99 gap/chat {by['gap']['ttft_ms_engine_time']['p99'] / by['chat']['ttft_ms_engine_time']['p99']:.2f}x"
            )
        verdict.append(
            f"  TTFT p99 affinity/chat {p99:.2f}x (goal >= 2x); hit rate chat/affinity {hit:.2f}x (goal >= 0.9x)"
        )
    return _report(args, rows, f"scenario hot (one prefix carries {100 * args.hot_share:.0f}% of the traffic)", verdict)


def _hot_admission_ratios(by: dict) -> tuple[float, float] | None:
    """(latency p95 affinity/chat, hit rate chat/affinity) of one run, None without both."""
    if "chat" not in by or "affinity" not in by or not by["chat"]["latency_warm_ms"]["p95"] > 0:
        return None
    p95 = by["affinity"]["latency_warm_ms"]["p95"] / by["chat"]["latency_warm_ms"]["p95"]
    hit = (
        by["chat"]["engine_hit_rate"] / by["affinity"]["engine_hit_rate"] if by["affinity"]["engine_hit_rate"] else 0.0
    )
    return p95, hit


def hot_open_verdict(by: dict) -> dict:
    """Scenario hot-open, one run: latency p95 affinity/chat over every request (none left
    out), the requests of each that were not answered (429s and errors), by fifth of the
    run too, and whether the run meets the goal (the ratio and chat's answering all)."""
    chat, aff = by["chat"], by["affinity"]
    ratio = (
        aff["latency_warm_ms"]["p95"] / chat["latency_warm_ms"]["p95"] if chat["latency_warm_ms"]["p95"] > 0 else 0.0
    )
    chat_declined = sum(chat["not_ok_by_fifth"])
    return {
        "ratio": ratio,
        "chat_declined": chat_declined,
        "affinity_declined": sum(aff["not_ok_by_fifth"]),
        "chat_declined_by_fifth": chat["not_ok_by_fifth"],
        "met": ratio >= HOT_OPEN_GOAL and chat_declined == 0,
    }


def _report_hot_admission(args, rows: list[dict]) -> int:
    by = {r["variant"]: r for r in rows}
    verdict = []
    for r in rows:
        lat, warm, load, adm = r["latency_ms_engine_time"], r["latency_warm_ms"], r["load"], r["admission"]
        verdict.append(
            f"  {r['variant']:<12} latency p50 {lat['p50']:6.0f} ms  p95 {lat['p95']:6.0f} ms  "
            f"p99 {lat['p99']:6.0f} ms; after the first {args.warmup_s:g} s p50 {warm['p50']:6.0f} ms  "
            f"p95 {warm['p95']:6.0f} ms  p99 {warm['p99']:6.0f} ms  "
            f"hot prefix per endpoint {r['group0_per_endpoint']}  "
            f"gateway queue mean {load.get('gateway_queued_mean')} (in {load.get('gateway_queued_share')} "
            f"of samples)  declined {adm['rejections']}  sla {adm['sla']}"
        )
        for name, e in sorted(load.get("endpoints", {}).items()):
            verdict.append(
                f"      {name}: in flight {e['inflight']:5.2f}  engine running {e['running']:5.2f}  "
                f"waiting {e['waiting']:5.2f} (max {e['waiting_max']:g})  limit {adm['limits'].get(name)}  "
                f"batch learned {adm['batch_capacity'].get(name)}"
            )
    ratios = _hot_admission_ratios(by)
    if args.scenario == "hot-open" and "chat" in by and "affinity" in by:
        v = hot_open_verdict(by)
        verdict.append(
            f"  latency p95 from the first second, affinity/chat {v['ratio']:.2f}x (goal >= "
            f"{HOT_OPEN_GOAL:g}x); not answered: chat {v['chat_declined']} (by fifth of the run "
            f"{v['chat_declined_by_fifth']}), affinity {v['affinity_declined']} (goal: chat none)"
        )
    elif ratios is not None:
        verdict.append(
            f"  latency p95 after the warm-up, affinity/chat {ratios[0]:.2f}x (goal >= 1.5x); "
            f"hit rate chat/affinity "
            f"{ratios[1]:.2f}x (goal >= 0.9x)"
        )
    return _report(
        args,
        rows,
        f"scenario {args.scenario} (one prefix carries {100 * args.hot_share:.0f}% of the "
        "traffic; the gateway at its defaults: dynamic admission, no models: section)",
        verdict,
    )


def _report(args, rows: list[dict], scenario: str, verdict: list[str], extra: dict | None = None) -> int:
    """A scenario's table: each variant's TTFT, throughput, hit rate and spread, then the
    goal's verdict lines; the runs (and ``extra``, the scenario's figures) as JSON with --output."""
    lines = [
        f"prefix bench, {scenario}: {args.requests} streamed chat requests at {args.rate:.0f}/s, "
        f"{args.groups} groups x {args.prefix_tokens}-token shared context + {args.suffix_tokens}-token "
        f"question, {args.output_tokens} tokens out, {args.engines} sim engines x {args.num_gpu_blocks} KV "
        f"blocks x {args.max_num_seqs} sequences, time scale {args.time_scale} (TTFT in engine time)"
    ]
    for r in rows:
        t = r["ttft_ms_engine_time"]
        lines.append(
            f"  {r['variant']:<13} TTFT p50 {t['p50']:8.0f} ms  p90 {t['p90']:8.0f} ms  p99 {t['p99']:8.0f} ms  "
            f"throughput {r['summary']['throughput_rps']:6.1f} req/s  "
            f"engine prefix-cache hit rate {100 * r['engine_hit_rate']:5.1f}%  "
            f"completed {r['summary']['completed']}/{r['summary']['requests']}  "
            f"per endpoint {r['requests_per_endpoint']}"
        )
    print("\n".join(lines + verdict))
    if args.output:
        write_json(args.output, {"args": vars(args), "runs": rows, **(extra or {})})
    return 0 if all(r["summary"]["completed"] == r["summary"]["requests"] for r in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="shared",
        help="shared (the profiles on shared prefixes), restart (an engine restarted halfway), "
        "replicas (two gateways): these two compare precise and approximate routing; "
        "hot (one prefix carries --hot-share of the traffic): spreading against pure affinity",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated routing profiles, or precise / approximate, and with replicas "
        "precise-1 / approximate-1 (one gateway) (default: "
        + ",".join(VARIANTS)
        + "; with restart or tenants "
        + ",".join(PRECISE_VARIANTS)
        + "; with replicas "
        + ",".join(REPLICAS_VARIANTS)
        + ")",
    )
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson), wall time")
    p.add_argument("--concurrency", type=int, default=32, help="client and per-engine in-flight bound")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=384,
        help="KV blocks (16 tokens) per engine: 384 keep about 5 groups' contexts of 16",
    )
    p.add_argument("--prefill-tps", type=float, default=5000.0)
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences an engine runs at once (vLLM's flag)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="the engines' context length (vLLM's flag): raise it with --prefix-tokens",
    )
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--restart-down-s",
        type=float,
        default=0.0,
        help="scenario restart: seconds (wall) engine 0 stays down before it starts again",
    )
    p.add_argument(
        "--hot-share",
        type=float,
        default=0.5,
        help="scenario hot: the share of the requests that carry the hot prefix (default 0.5)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the scenario this many times (seeds --seed, --seed+1, ...) and report each "
        "variant's TTFT over all runs' requests pooled, and the goal's ratio run by run",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="arrivals in the first seconds that scenario hot-admission's latency goal leaves out "
        "(each context's first prefill; default 8 there, 0 elsewhere)",
    )
    p.add_argument("--output", default=None, help="write the runs as JSON here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny counts ("
        + ", ".join(f"{k}={v}" for k, v in SMOKE.items())
        + "; flags given still win): checks that every variant runs, not what it gains",
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    elif any(a.endswith("tenants") for a in (sys.argv[1:] if argv is None else argv)):
        p.set_defaults(**TENANTS)
    elif any(a.endswith("replicas") for a in (sys.argv[1:] if argv is None else argv)):
        p.set_defaults(**REPLICAS)
    elif any(a.endswith("restart") for a in (sys.argv[1:] if argv is None else argv)):
        p.set_defaults(**RESTART)
    elif any(a.endswith("hot") for a in (sys.argv[1:] if argv is None else argv)):
        p.set_defaults(**HOT)
    elif any(a.endswith("hot-admission") for a in (sys.argv[1:] if argv is None else argv)):
        p.set_defaults(**HOT_ADMISSION)
    elif any(a.endswith("hot-open") for a in (sys.argv[1:] if argv is None else argv)):
        p.set_defaults(**HOT_OPEN)
    args = p.parse_args(argv)
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
