"""A Retry-After that keeps its promise: a burst declined at an SLA, and what its clients get back.

Method
------
* Two sim engines of --seqs sequences each (default 8: 16 slots), `velocityllm serve
  --sla-ms SLA` in front of them (default 2000), nothing else set.
* Warm-up: rounds of 16 requests of the burst's size, until the gateway has learned the
  service of such a request on both engines.
* A burst of --requests (default 160) requests at once, each on its own connection, each
  asking --max-tokens (default 40: about 0.85 s at a full batch). Those declined with
  429 `sla` retry once, after the time they were told (retry-after-ms, the header the
  OpenAI clients read first); on a fresh burst, after a tenth of it. Each retry is timed
  from its own write.
* Figures: of the clients that retried, the share served within the SLA, both ways; the
  span of the times told (first to last) against the burst's drain time (the requests
  times one service over the slots); the promises the gateway counted kept and broken.

Targets: at least 80 % of the clients that wait as told are served within
the SLA; those that come back at a tenth do at least 30 points worse; the times told
span most of the drain time (at least half).

Every process is on 127.0.0.1 and is stopped at the end, also on error or Ctrl-C.
Usage::

    python -m bench.retry_after [--requests 160] [--seqs 8] [--sla-ms 2000] [--json out.json]
    python -m bench.retry_after --smoke   # tiny and fast: it works, figures rough
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

import orjson

from velocity_fast.loadgen.client import Client
from velocity_fast.loadgen.isolation import MODEL, Fleet
from velocity_fast.loadgen.report import write_json

TOLD_AT_LEAST = 0.80
TENTH_POINTS_WORSE = 0.30
SPAN_AT_LEAST = 0.5
SMOKE = {"requests": 48, "seqs": 8, "time_scale": 4.0, "max_tokens": 20, "sla_ms": 250.0}


def wire(port: int, max_tokens: int) -> bytes:
    data = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "one answer"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    )
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def wait_idle(fleet: Fleet, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = await fleet.stats()
        adm = s.get("admission", {})
        if adm and adm["counters"]["in_flight"] == 0 and adm["queued"] == 0:
            return s
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not go idle")


async def warm_up(fleet: Fleet, data: bytes, seqs: int, rounds: int = 12) -> float:
    """Rounds of twice the engines' batches with an SLA far out, so that each engine shows
    its batch (or the gateway's limit is no more than it), until both engines' estimates
    are known; then one round of exactly the batches: the median of its times is one
    service at a full batch."""
    client = Client("127.0.0.1", fleet.port, timeout=120)
    long_sla = data.replace(b"content-type:", b"x-velocity-sla-ms: 600000\r\ncontent-type:", 1)
    slots = 2 * seqs

    async def round_of(n: int) -> list[float]:
        rs = await asyncio.gather(*(client.send(j, long_sla) for j in range(n)))
        bad = [r.status for r in rs if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up answered {bad}")
        return [r.done - r.sent for r in rs]

    try:
        for i in range(rounds):
            await round_of(2 * slots)
            eps = (await fleet.stats()).get("admission", {}).get("endpoints", {})
            if (
                i >= 1
                and eps
                and all(
                    e["estimates"]["tpot_ms"] is not None and (e["batch_capacity"] is not None or e["limit"] <= seqs)
                    for e in eps.values()
                )
            ):
                break
        await wait_idle(fleet)
        return statistics.median(await round_of(slots))
    finally:
        client.close()


async def burst(fleet: Fleet, data: bytes, n: int, sla_s: float, factor: float) -> dict:
    """``n`` requests at once; each declined one retries once after ``factor`` times the
    time it was told."""
    client = Client("127.0.0.1", fleet.port, timeout=120)

    async def one(i: int) -> dict:
        r = await client.send(i, data)
        out = {"status": r.status, "reason": r.reason, "took": r.done - r.sent, "told": r.retry_after}
        if r.status == 429 and r.retry_after is not None:
            await asyncio.sleep(r.retry_after * factor)
            again = await client.send(i, data)
            out["retry"] = {"status": again.status, "reason": again.reason, "took": again.done - again.sent}
        return out

    try:
        return {"answers": await asyncio.gather(*(one(i) for i in range(n)))}
    finally:
        client.close()


def figures(run: dict, sla_s: float) -> dict:
    answers = run["answers"]
    retried = [a for a in answers if "retry" in a]
    served = [a for a in retried if a["retry"]["status"] == 200 and a["retry"]["took"] <= sla_s]
    first_ok = [a for a in answers if a["status"] == 200]
    told = sorted(a["told"] for a in answers if a["told"] is not None and a["status"] == 429)
    return {
        "first_served": len(first_ok),
        "first_within_sla": sum(a["took"] <= sla_s for a in first_ok),
        "declined": sum(a["status"] == 429 for a in answers),
        "declined_sla": sum(a["status"] == 429 and a["reason"] == "sla" for a in answers),
        "retried": len(retried),
        "retry_served_within_sla": len(served),
        "retry_ok_share": len(served) / len(retried) if retried else None,
        "retry_statuses": {
            str(s): sum(a["retry"]["status"] == s for a in retried)
            for s in sorted({a["retry"]["status"] for a in retried})
        },
        "told_s": {"min": told[0], "max": told[-1], "distinct_ms": len({round(t * 1000) for t in told})}
        if told
        else None,
    }


async def run(
    *,
    requests: int = 160,
    seqs: int = 8,
    sla_ms: float = 2000.0,
    max_tokens: int = 40,
    time_scale: float = 1.0,
    log_dir: str | None = None,
) -> dict:
    """The whole measurement on a fresh fleet; the figures as a dict."""
    sla_s = sla_ms / 1000.0
    sim = ("--time-scale", f"{time_scale:g}", "--decode-tps", "50", "--batch-contention", "0.005")
    with tempfile.TemporaryDirectory(prefix="retry-after-") as tmp:
        fleet = Fleet(
            [["--max-num-seqs", str(seqs)]] * 2,
            "dynamic",
            log_dir or tmp,
            gateway_args=("--sla-ms", f"{sla_ms:g}"),
            sim_base=sim,
        )
        fleet.start()
        try:
            await fleet.wait_ready()
            data = wire(fleet.port, max_tokens)
            slots = 2 * seqs
            service = await warm_up(fleet, data, seqs)
            await wait_idle(fleet)
            told = figures(await burst(fleet, data, requests, sla_s, 1.0), sla_s)
            after_told = (await wait_idle(fleet))["admission"].get("retry_promises")
            tenth = figures(await burst(fleet, data, requests, sla_s, 0.1), sla_s)
            after_tenth = (await wait_idle(fleet))["admission"].get("retry_promises")
        finally:
            fleet.stop()
    drain = requests * service / slots
    span = (told["told_s"]["max"] - told["told_s"]["min"]) / drain if told["told_s"] else 0.0
    return {
        "requests": requests,
        "slots": slots,
        "sla_ms": sla_ms,
        "max_tokens": max_tokens,
        "time_scale": time_scale,
        "service_s": service,
        "drain_s": drain,
        "span_of_drain": span,
        "as_told": told,
        "at_a_tenth": tenth,
        "promises": {"after_as_told": after_told, "after_a_tenth": after_tenth},
    }


def report(res: dict) -> str:
    t, x = res["as_told"], res["at_a_tenth"]

    def pct(v):
        return "n/a" if v is None else f"{v * 100:.0f} %"

    lines = [
        f"burst of {res['requests']} against {res['slots']} slots at a {res['sla_ms']:g} ms SLA "
        f"({res['max_tokens']} tokens, {res['service_s'] * 1000:.0f} ms a request at a full batch; "
        f"drain {res['drain_s']:.2f} s)",
        f"  retry as told : {t['declined']} declined, {t['retry_served_within_sla']}/{t['retried']} "
        f"served within the SLA on retry ({pct(t['retry_ok_share'])}); first try {t['first_served']} "
        f"served, {t['first_within_sla']} within the SLA",
        f"  retry at 1/10 : {x['declined']} declined, {x['retry_served_within_sla']}/{x['retried']} "
        f"served within the SLA on retry ({pct(x['retry_ok_share'])}); retries answered {x['retry_statuses']}",
    ]
    if t["told_s"]:
        lines.append(
            f"  Retry-After told: {t['told_s']['min']:.3f} .. {t['told_s']['max']:.3f} s, "
            f"{t['told_s']['distinct_ms']} distinct times; span {res['span_of_drain']:.2f} of the drain time"
        )
    p = res["promises"]["after_as_told"]
    if p:
        lines.append(f"  promises (gateway): {p}")
    ok_t, ok_x = t["retry_ok_share"] or 0.0, x["retry_ok_share"] or 0.0
    lines.append(
        f"  targets: as told >= {TOLD_AT_LEAST:.0%}: {'met' if ok_t >= TOLD_AT_LEAST else 'MISSED'}; "
        f"a tenth >= {TENTH_POINTS_WORSE * 100:.0f} points worse: "
        f"{'met' if ok_t - ok_x >= TENTH_POINTS_WORSE else 'MISSED'}; span >= {SPAN_AT_LEAST}: "
        f"{'met' if res['span_of_drain'] >= SPAN_AT_LEAST else 'MISSED'}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--seqs", type=int, default=8, help="max-num-seqs of each of the two engines")
    p.add_argument("--sla-ms", type=float, default=2000.0)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--time-scale", type=float, default=1.0, help="the sims' speed-up (1: real time)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny (" + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + "): checks that it runs",
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    res = asyncio.run(
        run(
            requests=args.requests,
            seqs=args.seqs,
            sla_ms=args.sla_ms,
            max_tokens=args.max_tokens,
            time_scale=args.time_scale,
        )
    )
    print(report(res))
    if args.json:
        write_json(args.json, {"args": vars(args), **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
