"""Fairness between tenants budgeted in tokens: turns, the token counter charged on
estimates, the counter settled from what the engines served, and locality.

Seeded traffic through the gateway (in this process) to fresh sim engines, once per
variant (``admission.fairness`` and ``fairness_charge``):

- ``rr``: turns (a tenant with work waiting takes one slot per rotation, by weight);
- ``vtc-estimate``: the virtual token counter charged at dispatch with the estimate
  (body bytes / 4 + 2 x max_tokens) and never corrected (the counter before answers settled it);
- ``vtc-actual``: the same counter settled from the engines' usage when each answer
  ends (cached prompt tokens at 0.1);
- ``locality``: vtc-actual, and among the tenants within ``fairness_locality_bound`` of
  the least-served one, the request whose prefix an engine with room holds goes first.

Three tenants, all backlogged (each keeps ``--per-tenant`` requests outstanding), each
with its own long system prompt:

- ``prompts`` (weight 1): long prompts, short answers, a large max_tokens (512): the sim
  ends a reply by itself (``--natural-stop``, mean 16 tokens) as a model's end of
  sequence does, so its estimate is far above what it is served;
- ``answers`` (weight 1): short prompts, long answers (160 tokens, ignore_eos);
- ``mixed`` (weight 2): one of each in turn.

Reported per variant: each tenant's share of the service (prompt tokens, cached ones at
0.1, plus 2 x completion tokens: what the counter charges) against its weighted share;
the largest difference in weighted service (service / weight) between two tenants over
the run, against VTC's bound (twice the largest request's cost); the engines' prefix-cache
hit rate; throughput (engine tokens and requests a second).

    python -m bench.fairness [--duration 20] [--output out.json]
    python -m bench.fairness --smoke        # short: every variant runs, figures rough

On that traffic the router's prefix affinity already keeps each tenant's prefix where it
is cached, so locality has nothing to win. ``--scenario cache-bound`` is the regime it is
for (DLPM, arXiv 2501.14312): 16 tenants of weight 1 (``--tenants``), all backlogged,
each with its own long system prompt (about 1,500 tokens), short questions and answers
(``max_tokens`` 64, ending by themselves near 16), on two engines whose KV cache (448
blocks of 16 tokens) holds about four of those prompts each. By the counter alone the
turns go round all the tenants and each engine evicts the prefix it will need next;
locality serves, within its bound, the tenants whose prefix an engine with room holds.
Variants rr, vtc-actual and locality; each tenant's share is summed up as the least and
the largest; the gap is also counted in dispatch order (``x-velocity-queue-ms``), and the
gateway's own counters are sampled every 20 ms (their largest spread among backlogged
tenants). The goal line reads locality's bound as docs/operations.md states it, on the
counters: a request in flight is charged its estimate until its answer settles it, and on
this traffic the estimate of a prompt the engine has cached is about 8x what it is
settled to, so the service counted as answers end strays further (by what is in flight).

    python -m bench.fairness --scenario cache-bound [--duration 20]
    python -m bench.fairness --scenario cache-bound --smoke

``--scenario weights``: two tenants of weights 1 and 3 whose requests differ about 10x
in cost, each with 24 closed-loop clients, on two engines of 4 sequences behind the
gateway's own defaults (dynamic, 32 a engine, an SLA nothing misses), so that the engines
queue too and a tenant's queue at the gateway empties between its answers. ``heavy``
(weight 1) sends prompts of about 1,200 tokens with max_tokens 400 that the sim ends near
16; ``light`` (weight 3) sends prompts of about 70 tokens and gets 48. Reported per tenant:
its service in the window and divided by its weight; from /stats at the end, its counter,
the tokens the engines served it (divided by its weight) and what lifts added. Goal: the
weighted services within 1.5x, in the window and over the run, and each counter within
one request's cost of the weighted service.

    python -m bench.fairness --scenario weights [--duration 20]

Goals: vtc-actual within its bound where vtc-estimate is not; locality at
least 1.5x vtc-actual's hit rate and more throughput, within its own bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path

from bench.lib.engines import Engines, engine_hits
from velocity_fast.config import EndpointConfig, load_settings
from velocity_fast.gateway.app import Gateway

ROOT = Path(__file__).resolve().parents[1]

MODEL = "sim-model"
VARIANTS = ("rr", "vtc-estimate", "vtc-actual", "locality")
TENANTS = {"prompts": 1.0, "answers": 1.0, "mixed": 2.0}
# cache-bound: this many tenants alike (--tenants), each system prompt this many words
# (about 1,500 tokens: ~94 KV blocks), on engines of CACHE_BOUND_BLOCKS blocks (each about
# four prompts besides what its running requests add: the two hold about half the tenants').
CACHE_BOUND_TENANTS = 16
CACHE_BOUND_SYSTEM_WORDS = 920
CACHE_BOUND_BLOCKS = 448
# Each scenario's defaults, where they differ from the flags' own.
SCENARIOS = {
    "default": {
        "variants": ",".join(VARIANTS),
        "per_tenant": 12,
        "num_gpu_blocks": 400,
        "max_model_len": 3072,
        "policy": "static",
        "max_concurrency": 0,
        "sla_ms": 3000.0,
    },
    # The gateway's own defaults (dynamic, 32 a engine), with an SLA no request misses:
    # the engines' queues then hold work too, and a tenant's queue at the gateway empties.
    "weights": {
        "variants": "rr,vtc-actual",
        "per_tenant": 24,
        "num_gpu_blocks": 1200,
        "max_model_len": 3072,
        "policy": "dynamic",
        "max_concurrency": 32,
        "sla_ms": 600000.0,
    },
    "cache-bound": {
        "variants": "rr,vtc-actual,locality",
        "per_tenant": 4,
        "num_gpu_blocks": CACHE_BOUND_BLOCKS,
        "max_model_len": 2048,
        "policy": "static",
        "max_concurrency": 0,
        "sla_ms": 3000.0,
    },
}
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
    "tau upsilon phi chi psi omega"
).split()
OUT_W, CACHED_W = 2.0, 0.1
SMOKE = {"duration": 4.0, "warmup": 1.0}


def _variant_admission(variant: str, bound: float) -> dict:
    if variant == "rr":
        return {"fairness": "rr"}
    if variant == "vtc-estimate":
        return {"fairness": "tokens", "fairness_charge": "estimate"}
    if variant == "vtc-actual":
        return {"fairness": "tokens"}
    return {"fairness": "locality", "fairness_locality_bound": bound}


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


class Traffic:
    """Each tenant's seeded requests: its system prompt, then per request a question."""

    tenants = TENANTS

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.system = {"prompts": _text(rng, 1100), "answers": _text(rng, 180), "mixed": _text(rng, 500)}
        self.rng = {t: random.Random(seed * 31 + i) for i, t in enumerate(TENANTS)}
        self.count = {t: 0 for t in TENANTS}

    def body(self, tenant: str) -> bytes:
        rng = self.rng[tenant]
        k = self.count[tenant]
        self.count[tenant] += 1
        kind = tenant if tenant != "mixed" else ("prompts" if k % 2 == 0 else "answers")
        if kind == "prompts":
            question = _text(rng, 250)
            extra = {"max_tokens": 512}
        else:
            question = _text(rng, 12)
            extra = {"max_tokens": 160, "ignore_eos": True}
        return json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "system", "content": self.system[tenant]}, {"role": "user", "content": question}],
                **extra,
            }
        ).encode()


class WeightsTraffic:
    """Two tenants of weights 1 and 3 whose requests differ about 10x in cost: ``heavy``
    sends long prompts (about 1,200 tokens) with a large max_tokens (400) that the sim
    ends near 16 (``--natural-stop``), so its estimate is far above what it is served;
    ``light`` sends short prompts (about 70 tokens) and gets 48 tokens each."""

    tenants = {"heavy": 1.0, "light": 3.0}

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.system = {"heavy": _text(rng, 1150), "light": _text(rng, 50)}
        self.rng = {t: random.Random(seed * 31 + i) for i, t in enumerate(self.tenants)}

    def body(self, tenant: str) -> bytes:
        q = _text(self.rng[tenant], 40 if tenant == "heavy" else 12)
        extra = {"max_tokens": 400} if tenant == "heavy" else {"max_tokens": 48, "ignore_eos": True}
        return json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "system", "content": self.system[tenant]}, {"role": "user", "content": q}],
                **extra,
            }
        ).encode()


class CacheBoundTraffic:
    """Many tenants alike (weight 1): each its own long system prompt, then per request a
    short question and a short answer (``max_tokens`` 64; the sim ends it near 16), so
    the prompt's prefill is most of a request's work and a cached prefix saves it."""

    def __init__(self, seed: int, n: int = CACHE_BOUND_TENANTS) -> None:
        self.tenants = {f"t{i:02d}": 1.0 for i in range(n)}
        rng = random.Random(seed)
        self.system = {t: _text(rng, CACHE_BOUND_SYSTEM_WORDS) for t in self.tenants}
        self.rng = {t: random.Random(seed * 31 + i) for i, t in enumerate(self.tenants)}

    def body(self, tenant: str) -> bytes:
        return json.dumps(
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": self.system[tenant]},
                    {"role": "user", "content": _text(self.rng[tenant], 12)},
                ],
                "max_tokens": 64,
            }
        ).encode()


async def _post(reader, writer, port: int, tenant: str, body: bytes) -> tuple[int, dict | None, float]:
    """One request on the connection: its status, its JSON answer (200) and the seconds it
    waited in the gateway's queue (``x-velocity-queue-ms``)."""
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"x-velocity-tenant: %s\r\ncontent-length: %d\r\n\r\n" % (port, tenant.encode(), len(body)) + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length, queued = 0, 0.0
    for ln in lines[1:]:
        name = ln.split(":", 1)[0].lower()
        if name == "content-length":
            length = int(ln.split(":", 1)[1])
        elif name == "x-velocity-queue-ms":
            queued = float(ln.split(":", 1)[1]) / 1000.0
    data = await reader.readexactly(length)
    return status, (json.loads(data) if status == 200 else None), queued


def _cost(u: dict) -> float:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return u["prompt_tokens"] - cached + CACHED_W * cached + OUT_W * u["completion_tokens"]


def _dispatch_gap(rows: list[tuple], tenants: dict) -> float:
    """The largest difference in service / weight between two tenants, each request's
    service counted when the gateway dispatched it (the order the counter decides), not
    when it ended: what is in flight then (charged the estimate until it ends) does not
    show as a gap. (Every request dispatched in the window has ended: the clients wait for
    their answers before they stop.)"""
    service = {t: 0.0 for t in tenants}
    gap = 0.0
    for row in sorted(rows, key=lambda d: d[4]):
        service[row[1]] += row[2]
        norm = [service[t] / w for t, w in tenants.items()]
        gap = max(gap, max(norm) - min(norm))
    return gap


async def run_variant(variant: str, args) -> dict:
    flags = [
        "--time-scale",
        str(args.time_scale),
        "--natural-stop",
        "--natural-output-mean",
        "16",
        "--enable-prompt-tokens-details",
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--max-num-seqs",
        str(args.concurrency),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if args.scenario == "cache-bound":
        traffic = CacheBoundTraffic(args.seed, args.tenants)
    elif args.scenario == "weights":
        traffic = WeightsTraffic(args.seed)
    else:
        traffic = Traffic(args.seed)
    tenants = traffic.tenants
    if args.prefix_cache_blocks:
        flags += ["--prefix-cache-blocks", str(args.prefix_cache_blocks)]
    engines = Engines(args.engines, flags)
    gw = None
    try:
        await asyncio.to_thread(engines.start)
        eps = [
            EndpointConfig(name=f"e{i}", url=f"http://127.0.0.1:{p}", model=MODEL) for i, p in enumerate(engines.ports)
        ]
        settings = load_settings(
            None,
            {
                "host": "127.0.0.1",
                "port": 0,
                "admin_port": 0,
                "endpoints": eps,
                "policy": args.policy,
                "max_concurrency": args.max_concurrency or args.concurrency,
                "sla_ms": args.sla_ms,
                "routing": {"seed": args.seed},
                "tenants": [{"name": t, "weight": w} for t, w in tenants.items()],
                "admission": _variant_admission(variant, args.bound),
                "health": {"scrape_interval_ms": 50.0},
            },
            env={},
        )
        gw = Gateway(settings)
        await gw.start("127.0.0.1", 0, 0)
        deadline = time.monotonic() + 15
        while not all(ep.healthy for ep in gw.endpoints.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("engines did not turn healthy")
            await asyncio.sleep(0.05)
        port = gw.client_server.port
        # (time it ended, tenant, cost, engine tokens, time the gateway dispatched it, its estimate)
        done: list[tuple[float, str, float, int, float, float]] = []
        failed = 0
        start = time.monotonic()
        stop = start + args.warmup + args.duration

        async def worker(tenant: str) -> None:
            nonlocal failed
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while time.monotonic() < stop:
                    sent = time.monotonic()
                    body = traffic.body(tenant)
                    status, obj, queued = await _post(reader, writer, port, tenant, body)
                    if status != 200:
                        failed += 1
                        await asyncio.sleep(0.05)  # (a declined request is answered at once: no spin)
                        continue
                    u = obj["usage"]
                    done.append(
                        (
                            time.monotonic(),
                            tenant,
                            _cost(u),
                            u["prompt_tokens"] + u["completion_tokens"],
                            sent + queued,
                            len(body) / 4 + OUT_W * json.loads(body)["max_tokens"],
                        )
                    )
            finally:
                writer.close()

        counter_gap = 0.0

        async def counters() -> None:
            # The gateway's own counters (tokens / weight, what is in flight charged its
            # estimate), every 20 ms of the window: the spread among the backlogged
            # tenants is what the documented bounds speak of.
            nonlocal counter_gap
            while time.monotonic() < t1:
                if time.monotonic() >= t0:
                    values = [
                        b["counter"] for e in gw.tenant_stats().values() for b in e["bands"].values() if b["queued"] > 0
                    ]
                    if len(values) > 1:
                        counter_gap = max(counter_gap, max(values) - min(values))
                await asyncio.sleep(0.02)

        t0, t1 = start + args.warmup, stop
        sampler = asyncio.create_task(counters()) if variant != "rr" else None
        await asyncio.gather(*(worker(t) for t in tenants for _ in range(args.per_tenant)))
        if sampler is not None:
            await sampler
        hits, queries = await engine_hits(engines.ports)
        window = [d for d in done if t0 <= d[0] <= t1]
        service = {t: 0.0 for t in tenants}
        gap = 0.0
        for _, tenant, cost, *_ in sorted(window):
            service[tenant] += cost
            norm = [service[t] / w for t, w in tenants.items()]
            gap = max(gap, max(norm) - min(norm))
        gap_dispatch = _dispatch_gap([d for d in done if t0 <= d[4] <= t1], tenants)
        total = sum(service.values()) or 1.0
        wsum = sum(tenants.values())
        largest = max((d[2] for d in done), default=0.0)
        # The largest estimate charged at dispatch (body bytes / 4 + 2 x max_tokens).
        charge = max((d[5] for d in done), default=0.0)
        norm = [service[t] / w for t, w in tenants.items()]
        # The gateway's books at the end (nothing in flight): per tenant its counter and
        # the tokens the engines served it, as /stats shows them.
        books = {t: _books(gw.tenant_stats().get(t) or {}, w) for t, w in tenants.items()}
        whole = [b["weighted_served"] for b in books.values()]
        return {
            "variant": variant,
            "completed": len(window),
            "failed": failed,
            "service": service,
            "books": books,
            "share": {t: service[t] / total for t in tenants},
            "weighted_share": {t: w / wsum for t, w in tenants.items()},
            "max_gap": gap,
            "max_gap_dispatch": gap_dispatch,
            "vtc_bound": 2 * largest,
            "counter_gap": counter_gap if variant != "rr" else None,
            "counter_bound": 2 * charge,
            "locality_bound": args.bound if variant == "locality" else None,
            "hit_rate": hits / queries if queries else 0.0,
            "largest_cost": largest,
            "weighted_ratio": max(norm) / min(norm) if min(norm) > 0 else float("inf"),
            "books_ratio": max(whole) / min(whole) if min(whole) > 0 else float("inf"),
            "tokens_per_s": sum(d[3] for d in window) / args.duration,
            "requests_per_s": len(window) / args.duration,
        }
    finally:
        if gw is not None:
            with contextlib.suppress(Exception):
                await gw.stop(grace=1.0)
        await asyncio.to_thread(engines.stop)


def _books(entry: dict, weight: float) -> dict:
    """A tenant's /stats entry: its counter (the largest over bands) and the service the
    engines' usage says it was served (prompt, cached at 0.1, 2 x completion), / weight."""
    tok = entry.get("tokens") or {}
    served = (
        tok.get("prompt", 0) - tok.get("cached", 0) + CACHED_W * tok.get("cached", 0) + OUT_W * tok.get("completion", 0)
    )
    bands = list((entry.get("bands") or {}).values())
    top = max(bands, key=lambda b: b["counter"], default={})
    return {
        "counter": top.get("counter", 0.0),
        "lifted": top.get("lifted", 0.0),
        "served": served,
        "weighted_served": served / weight,
    }


def report_weights(rows: list[dict]) -> None:
    print(
        f"{'variant':13} {'tenant':7} {'weight':>6} {'service':>9} {'/ weight':>9} {'counter':>9} "
        f"{'served/w':>9} {'counter-served/w':>17} {'lifted':>8}"
    )
    for r in rows:
        for t, w in WeightsTraffic.tenants.items():
            b = r["books"][t]
            counter = "-" if r["variant"] == "rr" else f"{b['counter']:.0f}"
            diff = "-" if r["variant"] == "rr" else f"{b['counter'] - b['weighted_served']:.0f}"
            lifted = "-" if r["variant"] == "rr" else f"{b['lifted']:.0f}"
            print(
                f"{r['variant']:13} {t:7} {w:>6.0f} {r['service'][t]:>9.0f} {r['service'][t] / w:>9.0f} "
                f"{counter:>9} {b['weighted_served']:>9.0f} {diff:>17} {lifted:>8}"
            )
        print(
            f"{r['variant']:13} weighted services {r['weighted_ratio']:.2f}x apart in the window, "
            f"{r['books_ratio']:.2f}x over the whole run (largest / least)"
        )
    print("service: prompt + 0.1 x cached + 2 x completion tokens from usage, answers ended in the window;")
    print("counter: the gateway's fairness counter at the end (/stats); served/w: the tokens /stats says the")
    print("engines served the tenant over the whole run, as service / weight; the two should agree to within")
    print("one request's cost; lifted: what VTC's lifts added to the counter (a tenant whose queue emptied).")
    by = {r["variant"]: r for r in rows}
    a = by.get("vtc-actual")
    if a is not None:
        print(
            f"goal (vtc-actual: weighted services within 1.5x in the window and over the run, counters within "
            f"one request's cost ({a['largest_cost']:.0f}) of the service): {'met' if weights_goal(a) else 'NOT met'}"
        )


def weights_goal(r: dict) -> bool:
    """The weights scenario's goal for one variant's row."""
    agree = all(abs(b["counter"] - b["weighted_served"]) <= r["largest_cost"] for b in r["books"].values())
    return r["weighted_ratio"] <= 1.5 and r["books_ratio"] <= 1.5 and agree


def report(rows: list[dict]) -> None:
    names = list(TENANTS)
    print(
        f"{'variant':13} "
        + " ".join(f"{n + ' share':>15}" for n in names)
        + f" {'max gap':>9} {'bound':>9} {'hit rate':>9} {'tok/s':>8} {'req/s':>7}"
    )
    for r in rows:
        shares = " ".join(f"{r['share'][n]:>6.1%} of {r['weighted_share'][n]:>5.1%}" for n in names)
        bound = r["vtc_bound"] + (r["locality_bound"] or 0.0)
        print(
            f"{r['variant']:13} {shares} {r['max_gap']:>9.0f} {bound:>9.0f} {r['hit_rate']:>9.1%} "
            f"{r['tokens_per_s']:>8.0f} {r['requests_per_s']:>7.1f}"
        )
    print("share: of the service (prompt + 0.1 x cached + 2 x completion tokens) against the weighted share;")
    print("max gap: largest difference in service / weight between two tenants; bound: twice the largest")
    print("request's cost (VTC's), plus fairness_locality_bound for locality.")
    by = {r["variant"]: r for r in rows}
    if "vtc-actual" in by and "vtc-estimate" in by:
        a, e = by["vtc-actual"], by["vtc-estimate"]
        print(
            f"vtc-actual within its bound: {a['max_gap'] <= a['vtc_bound']}; "
            f"vtc-estimate: {e['max_gap'] <= e['vtc_bound']}"
        )
    if "locality" in by and "vtc-actual" in by:
        loc, a = by["locality"], by["vtc-actual"]
        ratio = loc["hit_rate"] / a["hit_rate"] if a["hit_rate"] else float("inf")
        print(
            f"locality: hit rate {ratio:.2f}x vtc-actual's, throughput {loc['tokens_per_s'] / a['tokens_per_s']:.2f}x, "
            f"within its bound: {loc['max_gap'] <= loc['vtc_bound'] + loc['locality_bound']}"
        )


def report_cache_bound(rows: list[dict]) -> None:
    print(
        f"{'variant':13} {'least share':>11} {'most share':>10} {'of':>6} {'max gap':>9} {'dispatched':>10} "
        f"{'bound':>9} {'counters':>9} {'bound':>9} {'hit rate':>9} {'tok/s':>8} {'req/s':>7}"
    )
    for r in rows:
        fair = next(iter(r["weighted_share"].values()))
        bound = r["vtc_bound"] + (r["locality_bound"] or 0.0)
        counters = "-" if r["counter_gap"] is None else f"{r['counter_gap']:.0f}"
        cbound = r["counter_bound"] + (r["locality_bound"] or 0.0)
        print(
            f"{r['variant']:13} {min(r['share'].values()):>11.1%} {max(r['share'].values()):>10.1%} {fair:>6.1%} "
            f"{r['max_gap']:>9.0f} {r['max_gap_dispatch']:>10.0f} {bound:>9.0f} {counters:>9} {cbound:>9.0f} "
            f"{r['hit_rate']:>9.1%} {r['tokens_per_s']:>8.0f} {r['requests_per_s']:>7.1f}"
        )
    print("share: the least and the largest tenant's part of the service (prompt + 0.1 x cached + 2 x completion")
    print("tokens) against the fair one; max gap: largest difference in service between two tenants, counted as")
    print("answers end; dispatched: the same counted when the gateway dispatched each request (what is in flight")
    print("is left out); bound: twice the largest request's cost (VTC's), plus fairness_locality_bound for locality;")
    print("counters: the largest spread of the gateway's counters among backlogged tenants (in flight: charged the")
    print("estimate); bound: twice the largest estimate, plus fairness_locality_bound for locality.")
    r = ratios(rows)
    if r is not None:
        print(
            f"locality: hit rate {r['hit_rate']:.2f}x vtc-actual's, throughput {r['throughput']:.2f}x, "
            f"service gap {r['gap_over_vtc']:.0f} over vtc-actual's (fairness_locality_bound "
            f"{r['locality_bound']:.0f}); service gap within its bound: locality {r['within_bound']}, "
            f"vtc-actual {r['vtc_within_bound']}; counters within theirs: locality {r['counters_within_bound']}, "
            f"vtc-actual {r['vtc_counters_within_bound']}"
        )
        print(
            f"goal (at least 1.5x the hit rate, more throughput, counters within the documented bound): "
            f"{'met' if r['goal_met'] else 'NOT met'}"
        )


def ratios(rows: list[dict]) -> dict | None:
    """Locality against vtc-actual (the goal's figures), when both ran."""
    by = {r["variant"]: r for r in rows}
    if "locality" not in by or "vtc-actual" not in by:
        return None
    loc, a = by["locality"], by["vtc-actual"]
    hit = loc["hit_rate"] / a["hit_rate"] if a["hit_rate"] else float("inf")
    tput = loc["tokens_per_s"] / a["tokens_per_s"] if a["tokens_per_s"] else float("inf")
    counters = loc["counter_gap"] <= loc["counter_bound"] + loc["locality_bound"]
    return {
        "hit_rate": hit,
        "throughput": tput,
        "gap_over_vtc": loc["max_gap"] - a["max_gap"],
        "locality_bound": loc["locality_bound"],
        "within_bound": loc["max_gap"] <= loc["vtc_bound"] + loc["locality_bound"],
        "vtc_within_bound": a["max_gap"] <= a["vtc_bound"],
        "counters_within_bound": counters,
        "vtc_counters_within_bound": a["counter_gap"] <= a["counter_bound"],
        "goal_met": hit >= 1.5 and tput > 1.0 and counters,
    }


async def main_async(args) -> int:
    rows = []
    for v in args.variants.split(","):
        rows.append(await run_variant(v, args))
    if args.scenario == "cache-bound":
        report_cache_bound(rows)
    elif args.scenario == "weights":
        report_weights(rows)
    else:
        report(rows)
    if args.output:
        Path(args.output).write_text(
            json.dumps({"args": vars(args), "runs": rows, "locality_vs_vtc": ratios(rows)}, indent=2)
        )
    return 0 if all(r["completed"] > 0 for r in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--scenario",
        choices=tuple(SCENARIOS),
        default="default",
        help="default: three tenants; cache-bound: many tenants whose prompts the KV caches cannot all hold; "
        "weights: two tenants of weights 1 and 3 whose requests differ 10x in size",
    )
    p.add_argument("--variants", default=None, help="comma-separated (default: the scenario's)")
    p.add_argument("--tenants", type=int, default=CACHE_BOUND_TENANTS, help="cache-bound: how many tenants")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per variant (after the warm-up)")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument(
        "--per-tenant",
        type=int,
        default=None,
        help="requests each tenant keeps outstanding (default: 12, cache-bound 4)",
    )
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per engine (and its batch)")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help=f"each engine's KV blocks of 16 tokens (default: 400, cache-bound {CACHE_BOUND_BLOCKS})",
    )
    p.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=0,
        help="freed blocks each engine keeps for its prefix cache (0: all, the sim's default)",
    )
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--bound", type=float, default=4000.0, help="fairness_locality_bound for locality")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--policy", default=None, help="the gateway's admission policy (default: static; weights: dynamic)")
    p.add_argument("--sla-ms", type=float, default=None, help="the gateway's sla_ms (default 3000; weights: 600000)")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="the gateway's max_concurrency per engine (default: --concurrency; weights: 32)",
    )
    p.add_argument("--output")
    p.add_argument("--smoke", action="store_true", help="short runs: every variant runs, figures rough")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    for key, value in SCENARIOS[args.scenario].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
