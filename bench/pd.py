"""Prefill/decode disaggregation against the same engines colocated (docs/pd.md).

Each run starts fresh sim engines (empty caches) and a gateway (`velocityllm serve`, the
`static` policy with room for every request, so admission queues nothing and the figures
are the engines' and the routing's), and plays one seeded open-loop workload of streamed
chat requests with unique prompts:

* long-prompt: about 4,000 prompt tokens and 128 out (prefill-heavy);
* long-answer: about 256 prompt tokens and 512 out (decode-heavy).

Topologies, on the same engines: 1P1D (one prefill, one decode engine) against the two
engines colocated (role both), and 2P2D against four colocated. Reported per run: TTFT
p50/p99 (to the first content token), ITL p50/p99 (every gap between tokens),
throughput (completion tokens per second over the run), the share of requests the
decider ran on the decode engine alone (`/stats`' pd counts), the gateway's CPU per
request (user + system, from /proc), and failures.

The sim engine's costs are a data-centre GPU's (sim/settings.py: 5,000 prefill tokens/s,
50 tokens/s per sequence at batch 1, a KV block's pull 0.1 ms), sped up by
``--time-scale``; times are reported unscaled (multiplied back), rates are per unscaled
second.

    python -m bench.pd                       # both workloads, 1P1D and 2P2D
    python -m bench.pd --smoke               # a few seconds each: it works, figures rough
    python -m bench.pd --topologies 1P1D --workloads long-prompt --min-uncached 0
    python -m bench.pd --topologies 1P1D --workloads long-answer --prompt-tokens 128 --min-uncached 0
    python -m bench.pd --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.lib.load import open_loop, post_wire
from bench.lib.procfs import CLK_TCK, cpu_ticks
from velocity_fast.harness.gateway import GatewayProcess
from velocity_fast.harness.ports import free_port
from velocity_fast.harness.probe import http_status, wait_until
from velocity_fast.harness.procs import stop_all
from velocity_fast.harness.sim import SimEngine

MODEL = "sim-model"
# name: (prompt tokens, completion tokens, requests per unscaled second per engine pair)
WORKLOADS = {
    "long-prompt": (4000, 128, 0.8),
    "long-answer": (256, 512, 2.0),
}
TOPOLOGIES = {"1P1D": ("prefill", "decode"), "2P2D": ("prefill", "prefill", "decode", "decode")}


def _prompt(rng: random.Random, tokens: int) -> str:
    # The sim counts 4 bytes a token: words of 8 bytes ("w" + 6 digits + a space), unique.
    return " ".join(f"w{rng.randrange(10**6):06d}" for _ in range(tokens // 2))


def make_wire(prompt_tokens: int, out_tokens: int):
    def wire(rng: random.Random) -> bytes:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": _prompt(rng, prompt_tokens)}],
            "max_tokens": out_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        return post_wire("/v1/chat/completions", json.dumps(body).encode())

    return wire


def _get_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _config(urls: list[str], roles: tuple[str, ...], min_uncached: int | None) -> str:
    lines = ["policy: static", "max_concurrency: 256", "sla_ms: 86400000", "endpoints:"]
    for i, (url, role) in enumerate(zip(urls, roles), 1):
        lines.append(f"  - {{name: e{i}, url: '{url}', model: {MODEL}, role: {role}}}")
    if min_uncached is not None:
        lines.append(f"pd: {{min_uncached_tokens: {min_uncached}}}")
    return "\n".join(lines) + "\n"


def run_one(
    roles: tuple[str, ...],
    workload: str,
    *,
    seconds: float,
    scale: float,
    seed: int,
    min_uncached: int | None,
    prompt_tokens: int | None = None,
) -> dict:
    default_prompt, out_tokens, rate = WORKLOADS[workload]
    prompt_tokens = prompt_tokens or default_prompt
    pairs = len(roles) / 2
    sims: list[SimEngine] = []
    gp = None
    with tempfile.TemporaryDirectory(prefix="velocity-pd-") as tmp:
        work = Path(tmp)
        try:
            for i in range(len(roles)):
                eng = SimEngine(
                    "--max-model-len",
                    "8192",
                    "--enable-prompt-tokens-details",
                    model=MODEL,
                    port=free_port(),
                    time_scale=scale,
                    log=work / f"engine-{i}.log",
                    death_signal=signal.SIGTERM,
                )
                sims.append(eng)
                eng.start(20)
            config = work / "config.yaml"
            config.write_text(_config([e.url for e in sims], roles, min_uncached))
            log = work / "gateway.log"
            gp = GatewayProcess(
                "serve", "--config", str(config), "--log-level", "warning", log=log, death_signal=signal.SIGTERM
            ).spawn()
            wait_until(lambda: http_status(gp.admin_port, "/ready") == 200, 30, "the gateway", log)
            before = sum(cpu_ticks(gp.proc.pid))
            results, sent = asyncio.run(
                open_loop(
                    gp.port,
                    rate * pairs * scale,
                    seconds,
                    make_wire(prompt_tokens, out_tokens),
                    seed=seed,
                    connections=512,
                    timeout=120.0,
                )
            )
            cpu_s = (sum(cpu_ticks(gp.proc.pid)) - before) / CLK_TCK
            stats = _get_json(gp.admin_port, "/stats")
            held = [_get_json(e.port, "/kv_transfer/stats")["held_blocks"] for e in sims]
        finally:
            stop_all([gp and gp.proc, *(e.proc for e in reversed(sims))], 5.0, whole=True)
    ok = [r for r in results if r is not None and r.ok]
    ttft = [(r.first_token - r.sent) * scale * 1000.0 for r in ok if r.first_token is not None]
    itl = [g * scale * 1000.0 for r in ok for g in r.gaps]
    span = (max(r.done for r in ok) - min(r.sent for r in ok)) * scale if ok else 0.0
    pd = stats.get("pd", {}).get(MODEL, {"disaggregated": 0, "colocated": len(ok)})
    ways = pd["disaggregated"] + pd["colocated"]
    return {
        "topology": "+".join(roles),
        "workload": workload,
        "prompt_tokens": prompt_tokens,
        "sent": sent,
        "ok": len(ok),
        "failed": sent - len(ok),
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "itl_p50_ms": _pct(itl, 0.5),
        "itl_p99_ms": _pct(itl, 0.99),
        "throughput_tok_s": sum(r.output_tokens for r in ok) / span if span else None,
        "decider_skip_share": pd["colocated"] / ways if ways else None,
        "held_blocks_after": sum(held),
        # The gateway's CPU (user + system, clock ticks: rough at smoke size) per request.
        "gateway_cpu_ms_per_request": cpu_s * 1000.0 / sent if sent else None,
    }


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", default="1P1D,2P2D", help="comma-separated: 1P1D, 2P2D")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--seconds", type=float, default=None, help="scaled seconds of load a run (default 20)")
    ap.add_argument("--time-scale", type=float, default=None, help="the sim engines' speed-up (default 10)")
    ap.add_argument("--min-uncached", type=int, default=None, help="pd.min_uncached_tokens (default: the gateway's)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="the prompts' length (default: the workload's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="1P1D, 3 s a run, time scale 20: it works, figures rough")
    ap.add_argument("--json", default=None, help="write the runs here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.topologies = "1P1D"
    seconds = args.seconds if args.seconds is not None else (3.0 if args.smoke else 20.0)
    scale = args.time_scale if args.time_scale is not None else (20.0 if args.smoke else 10.0)
    runs = []
    for topo in args.topologies.split(","):
        roles = TOPOLOGIES[topo]
        for workload in args.workloads.split(","):
            for arrangement, rs in (("colocated", ("both",) * len(roles)), (topo, roles)):
                t0 = time.monotonic()
                r = run_one(
                    rs,
                    workload,
                    seconds=seconds,
                    scale=scale,
                    seed=args.seed,
                    min_uncached=args.min_uncached,
                    prompt_tokens=args.prompt_tokens,
                )
                r["setup"] = f"{topo} {arrangement}"
                runs.append(r)
                print(
                    f"{r['setup']:>18} {workload:>11}: ok {r['ok']}/{r['sent']}  TTFT p50/p99 "
                    f"{_fmt(r['ttft_p50_ms'])}/{_fmt(r['ttft_p99_ms'])} ms  ITL p50/p99 "
                    f"{_fmt(r['itl_p50_ms'])}/{_fmt(r['itl_p99_ms'])} ms  {_fmt(r['throughput_tok_s'])} tok/s  "
                    f"skipped {_fmt(r['decider_skip_share'])}  held after {r['held_blocks_after']}  "
                    f"gateway CPU {_fmt(r['gateway_cpu_ms_per_request'])} ms/req  "
                    f"({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    failed = sum(r["failed"] for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
