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

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.engines import Engines, engine_hits
from velocity_fast.config import EndpointConfig, load_settings
from velocity_fast.gateway.app import Gateway

MODEL = "sim-model"
VARIANTS = ("rr", "vtc-estimate", "vtc-actual", "locality")
TENANTS = {"prompts": 1.0, "answers": 1.0, "mixed": 2.0}
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()
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
        return json.dumps({"model": MODEL, "messages": [{"role": "system", "content": self.system[tenant]},
                                                        {"role": "user", "content": question}], **extra}).encode()


async def _post(reader, writer, port: int, tenant: str, body: bytes) -> tuple[int, dict | None]:
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
                 b"x-velocity-tenant: %s\r\ncontent-length: %d\r\n\r\n" % (port, tenant.encode(), len(body)) + body)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for ln in lines[1:]:
        if ln.lower().startswith("content-length:"):
            length = int(ln.split(":", 1)[1])
    data = await reader.readexactly(length)
    return status, (json.loads(data) if status == 200 else None)


def _cost(u: dict) -> float:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return u["prompt_tokens"] - cached + CACHED_W * cached + OUT_W * u["completion_tokens"]


async def run_variant(variant: str, args) -> dict:
    flags = ["--time-scale", str(args.time_scale), "--natural-stop", "--natural-output-mean", "16",
             "--enable-prompt-tokens-details", "--num-gpu-blocks", str(args.num_gpu_blocks),
             "--max-num-seqs", str(args.concurrency), "--max-model-len", "3072"]
    if args.prefix_cache_blocks:
        flags += ["--prefix-cache-blocks", str(args.prefix_cache_blocks)]
    engines = Engines(args.engines, flags)
    gw = None
    try:
        await asyncio.to_thread(engines.start)
        eps = [EndpointConfig(name=f"e{i}", url=f"http://127.0.0.1:{p}", model=MODEL)
               for i, p in enumerate(engines.ports)]
        settings = load_settings(None, {
            "host": "127.0.0.1", "port": 0, "admin_port": 0, "endpoints": eps, "policy": "static",
            "max_concurrency": args.concurrency, "routing": {"seed": args.seed},
            "tenants": [{"name": t, "weight": w} for t, w in TENANTS.items()],
            "admission": _variant_admission(variant, args.bound),
            "health": {"scrape_interval_ms": 50.0}}, env={})
        gw = Gateway(settings)
        await gw.start("127.0.0.1", 0, 0)
        deadline = time.monotonic() + 15
        while not all(ep.healthy for ep in gw.endpoints.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("engines did not turn healthy")
            await asyncio.sleep(0.05)
        port = gw.client_server.port
        traffic = Traffic(args.seed)
        done: list[tuple[float, str, float, int]] = []  # (time, tenant, cost, engine tokens)
        failed = 0
        start = time.monotonic()
        stop = start + args.warmup + args.duration

        async def worker(tenant: str) -> None:
            nonlocal failed
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while time.monotonic() < stop:
                    status, obj = await _post(reader, writer, port, tenant, traffic.body(tenant))
                    if status != 200:
                        failed += 1
                        continue
                    u = obj["usage"]
                    done.append((time.monotonic(), tenant, _cost(u), u["prompt_tokens"] + u["completion_tokens"]))
            finally:
                writer.close()

        await asyncio.gather(*(worker(t) for t in TENANTS for _ in range(args.per_tenant)))
        hits, queries = await engine_hits(engines.ports)
        t0, t1 = start + args.warmup, stop
        window = [d for d in done if t0 <= d[0] <= t1]
        service = {t: 0.0 for t in TENANTS}
        gap = 0.0
        for _, tenant, cost, _ in sorted(window):
            service[tenant] += cost
            norm = [service[t] / w for t, w in TENANTS.items()]
            gap = max(gap, max(norm) - min(norm))
        total = sum(service.values()) or 1.0
        wsum = sum(TENANTS.values())
        largest = max((d[2] for d in done), default=0.0)
        return {"variant": variant, "completed": len(window), "failed": failed,
                "share": {t: service[t] / total for t in TENANTS},
                "weighted_share": {t: w / wsum for t, w in TENANTS.items()},
                "max_gap": gap, "vtc_bound": 2 * largest,
                "locality_bound": args.bound if variant == "locality" else None,
                "hit_rate": hits / queries if queries else 0.0,
                "tokens_per_s": sum(d[3] for d in window) / args.duration,
                "requests_per_s": len(window) / args.duration}
    finally:
        if gw is not None:
            with contextlib.suppress(Exception):
                await gw.stop(grace=1.0)
        await asyncio.to_thread(engines.stop)


def report(rows: list[dict]) -> None:
    names = list(TENANTS)
    print(f"{'variant':13} " + " ".join(f"{n + ' share':>15}" for n in names)
          + f" {'max gap':>9} {'bound':>9} {'hit rate':>9} {'tok/s':>8} {'req/s':>7}")
    for r in rows:
        shares = " ".join(f"{r['share'][n]:>6.1%} of {r['weighted_share'][n]:>5.1%}" for n in names)
        bound = r["vtc_bound"] + (r["locality_bound"] or 0.0)
        print(f"{r['variant']:13} {shares} {r['max_gap']:>9.0f} {bound:>9.0f} {r['hit_rate']:>9.1%} "
              f"{r['tokens_per_s']:>8.0f} {r['requests_per_s']:>7.1f}")
    print("share: of the service (prompt + 0.1 x cached + 2 x completion tokens) against the weighted share;")
    print("max gap: largest difference in service / weight between two tenants; bound: twice the largest")
    print("request's cost (VTC's), plus fairness_locality_bound for locality.")
    by = {r["variant"]: r for r in rows}
    if "vtc-actual" in by and "vtc-estimate" in by:
        a, e = by["vtc-actual"], by["vtc-estimate"]
        print(f"vtc-actual within its bound: {a['max_gap'] <= a['vtc_bound']}; "
              f"vtc-estimate: {e['max_gap'] <= e['vtc_bound']}")
    if "locality" in by and "vtc-actual" in by:
        loc, a = by["locality"], by["vtc-actual"]
        ratio = loc["hit_rate"] / a["hit_rate"] if a["hit_rate"] else float("inf")
        print(f"locality: hit rate {ratio:.2f}x vtc-actual's, throughput {loc['tokens_per_s'] / a['tokens_per_s']:.2f}x, "
              f"within its bound: {loc['max_gap'] <= loc['vtc_bound'] + loc['locality_bound']}")


async def main_async(args) -> int:
    rows = []
    for v in args.variants.split(","):
        rows.append(await run_variant(v, args))
    report(rows)
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    return 0 if all(r["completed"] > 0 for r in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per variant (after the warm-up)")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--per-tenant", type=int, default=12, help="requests each tenant keeps outstanding")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per engine (and its batch)")
    p.add_argument("--num-gpu-blocks", type=int, default=400, help="each engine's KV blocks (16 tokens)")
    p.add_argument("--prefix-cache-blocks", type=int, default=0,
                   help="freed blocks each engine keeps for its prefix cache (0: all, the sim's default)")
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--bound", type=float, default=4000.0, help="fairness_locality_bound for locality")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output")
    p.add_argument("--smoke", action="store_true", help="short runs: every variant runs, figures rough")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
