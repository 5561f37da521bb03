"""Priority isolation at default settings, for the bench (bench/isolation.py --matrix) and
the e2e test: sim engines whose batch the gateway is not told, `velocityllm serve` in
front of them with nothing but `--policy`, a flood of `low` requests kept in flight, and
short `high` streaming requests timed against their own idle figure.

Low clients behave as clients do: each keeps one request in flight, and one declined
with Retry-After waits that long (bounded by ``backoff_cap``) before its next.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import orjson

from ..harness import stack
from ..harness.stack import MODEL
from .client import Client, frozen_heap

# 2x real time, 50 tokens/s per sequence; the sim's default contention per sequence.
BASE_SIM = ("--time-scale", "2", "--decode-tps", "50", "--batch-contention", "0.005")
HIGH_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "status?"}],
    "max_tokens": 24,
    "stream": True,
    "ignore_eos": True,
}
LOW_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "write a long essay"}],
    "max_tokens": 96,
    "ignore_eos": True,
}

#: The matrix: name -> one argument list per engine (on top of BASE_SIM).
SCENARIOS: dict[str, list[list[str]]] = {
    "seqs-8": [["--max-num-seqs", "8"]] * 2,
    "seqs-16": [["--max-num-seqs", "16"]] * 2,
    "seqs-64": [["--max-num-seqs", "64"]] * 2,
    # Batch bound by KV blocks: 256 sequences allowed, 160 blocks of 16 tokens hold ~20
    # low requests (about 130 tokens each with the chat template).
    "kv-bound": [["--max-num-seqs", "256", "--num-gpu-blocks", "160", "--max-model-len", "2048"]] * 2,
    "mixed-8-64": [["--max-num-seqs", "8"], ["--max-num-seqs", "64"]],
}

# --long: requests whose KV grows well past their prompt as they decode.
LONG = dict(
    sim_base=(),
    low_body={
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["word"] * 110)}],
        "max_tokens": 200,
        "ignore_eos": True,
    },
    high_body={
        "model": MODEL,
        "messages": [{"role": "user", "content": "status?"}],
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
    },
)
#: Engines whose batch is bound by KV blocks, for LONG: 256 blocks of 16 tokens hold about
#: 12 low requests once their 200 tokens are decoded (prompt blocks shared), at admission
#: a few times that.
KV_BOUND_LONG = [["--max-num-seqs", "256", "--num-gpu-blocks", "256"]] * 2


def wire(port: int, body: dict, band: str) -> bytes:
    """The request bytes of one chat completion in ``band``."""
    data = orjson.dumps(body)
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\nx-velocity-priority: {band}\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    xs = sorted(xs)
    k = max(1, min(len(xs), int(-(-q * len(xs) // 100))))
    return xs[k - 1]


@dataclass
class Fleet(stack.Fleet):
    """The harness's sim engines and default-flag gateways, the engines at this file's pace."""

    sim_base: tuple[str, ...] = BASE_SIM


async def high_series(
    client: Client,
    port: int,
    n: int,
    spacing: float,
    cap: float | None = None,
    body: dict = HIGH_BODY,
    band: str = "high",
) -> tuple[list[float], int]:
    """n streaming requests of ``band`` (high unless told), one every ``spacing`` s:
    (latencies of the ok ones, failures).

    With ``cap`` (seconds), a request still unanswered then is given up and counts as
    ``cap``: its latency is at least that, which is all a verdict of "at least so much
    worse" needs (the static runs: :func:`measure`)."""
    data = wire(port, body, band)

    async def one(i: int):
        await asyncio.sleep(i * spacing)
        if cap is None:
            r = await client.send(i, data)
        else:
            try:
                async with asyncio.timeout(cap):
                    r = await client.send(i, data)
            except TimeoutError:
                return cap
        return (r.done - r.sent) if r.ok else None

    out = await asyncio.gather(*(one(i) for i in range(n)))
    ok = [x for x in out if x is not None]
    return ok, len(out) - len(ok)


def noise(a: list[float], b: list[float]) -> float:
    """How far the p95s of two series of the same idle work lie apart (1.0 = not at all).

    Both series ran on the same gateway a second apart, so their difference is the
    machine's (a descheduled moment of 2 shared cores), the same noise that a loaded
    series sees on top of the load's own effect.
    """
    if not a or not b:
        return float("inf")
    pa, pb = percentile(a, 95), percentile(b, 95)
    return max(pa, pb) / min(pa, pb)


async def poll_stats(fleet: Fleet, timeout: float, done, interval: float) -> dict:
    """Admin /stats read every ``interval`` seconds until ``done(previous, now)`` holds, or
    ``timeout`` passes: the last stats then, as they stand. Each wait below is one such
    condition on what the gateway has learned, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    last = await fleet.stats()
    if done(None, last):
        return last
    while time.monotonic() < deadline:
        await asyncio.sleep(interval)
        now = await fleet.stats()
        if done(last, now):
            return now
        last = now
    return last


def _endpoints(st: dict | None) -> dict:
    return (st or {}).get("admission", {}).get("endpoints", {})


def _learned(st: dict | None) -> dict:
    return {n: (e.get("limit"), e.get("batch_capacity")) for n, e in _endpoints(st).items()}


async def settled(fleet: Fleet, timeout: float) -> dict:
    """Admin /stats once what admission learns under load has stopped moving.

    The loaded series must measure the gateway's steady state, not its learning: each
    engine's concurrency limit and learned batch are read twice, half a second apart,
    until they agree."""
    return await poll_stats(
        fleet,
        timeout,
        lambda last, now: last is not None and bool(_learned(now)) and _learned(now) == _learned(last),
        0.5,
    )


async def learned_batches(fleet: Fleet, timeout: float) -> dict:
    """Admin /stats once the gateway knows every engine's batch.

    Replicas learn an engine's batch from its gauges, when it queues beside as many
    running as ever (admission/saturation.pyx); each sees the same scrapes, so a flood
    through one teaches them all. Spread over replicas that hold back for each other,
    it may never queue the engine: a replica's slow start then learns the batch in the
    middle of a measurement, by overshooting it for about one service time."""

    def done(_last, now):
        eps = _endpoints(now)
        return bool(eps) and all(e.get("batch_capacity") is not None for e in eps.values())

    return await poll_stats(fleet, timeout, done, 0.2)


async def flooded(fleet: Fleet, timeout: float) -> dict:
    """Admin /stats once the gateway's queue holds requests: under ``static`` nothing is
    learned, and the FIFO holds the flood as soon as it arrives."""
    return await poll_stats(fleet, timeout, lambda _last, now: bool(now.get("admission", {}).get("queued")), 0.1)


def static_verdict(dyn: dict) -> dict:
    """:func:`measure`'s arguments for a static run that only has to show the load is real
    (at least 10x): judged against the dynamic run ``dyn``'s idle series, measured seconds
    before on the same engines, and a high request unanswered at 12x that idle p95 counts
    as 12x (the verdict needs no more; bench/isolation.py measures static's whole figure)."""
    return {"idle_from": dyn, "at_least": 10.0}


async def run(engine_args: list[list[str]], policy: str, log_dir: str, **kw) -> dict:
    """One scenario under one policy: idle and loaded high series on a fresh fleet (the
    arguments of :func:`measure`), with the caller's heap left out of garbage collection
    meanwhile (:func:`frozen_heap`: the client's pauses are not the gateway's)."""
    with frozen_heap():
        return await measure(engine_args, policy, log_dir, **kw)


async def measure(
    engine_args: list[list[str]],
    policy: str,
    log_dir: str,
    *,
    low: int = 300,
    high_samples: int = 40,
    spacing: float = 0.1,
    backlog: float = 4.0,
    backoff_cap: float = 2.0,
    settle_timeout: float = 15.0,
    replicas: int = 1,
    workers: int = 1,
    idle_from: dict | None = None,
    at_least: float | None = None,
    at: float | None = None,
    low_body: dict = LOW_BODY,
    high_body: dict = HIGH_BODY,
    sim_base: tuple[str, ...] = BASE_SIM,
) -> dict:
    """One scenario under one policy: idle and loaded high series on a fresh fleet.

    With ``replicas`` gateways in front of the same engines, the low clients are spread
    over them in turn and the high series goes to the first: what the others send is
    known to it only through the engines' own gauges. Under an adaptive policy the flood
    first goes through the first replica alone, until the engines' batches are learned
    (:func:`learned_batches`): the loaded series measures the replicas' steady state.
    With ``workers`` each gateway runs that many processes on one port, sharing their
    counts in memory.

    For a run that only has to show the load is real (``static``, at least 10x idle):
    ``idle_from`` is another run's result on the same engines, seconds before, whose idle
    series stands for this one's (none is measured); ``at_least`` is the ratio the
    verdict needs, and a loaded request still unanswered at 1.2 times that ratio of the
    idle p95 counts as that long (``loaded_ms["capped"]``: the ratio is then a lower
    bound). Under ``static`` the loaded series starts once the gateway's queue holds
    requests, with nothing to learn first.

    With ``at`` (seconds), the first-second measurement: the loaded series starts that
    long after the flood does, whatever admission has learned by then (``at=0``: the
    flood and the high series start together, on engines whose batch nothing has filled
    yet). Users' floods do not wait for the learned state. ``low_body``, ``high_body`` and
    ``sim_base`` replace the requests and the engines' common flags."""
    fleet = Fleet(engine_args, policy, log_dir, replicas=replicas, workers=workers, sim_base=sim_base)
    fleet.start()
    try:
        await fleet.wait_ready()
        high = Client("127.0.0.1", fleet.port, timeout=300)
        low_clients = [Client("127.0.0.1", port, timeout=300) for port in fleet.ports]
        counts = {"ok": 0, "declined": 0, "failed": 0}
        try:
            await high_series(high, fleet.port, 4, 0.05, body=high_body)  # warm connections and estimators
            # Two idle series: their p95s differ only by the machine's noise in this run,
            # which sets the margin a loaded p95 is judged with (``noise``).
            if idle_from is None:
                idle_a, failed_a = await high_series(high, fleet.port, high_samples, spacing, body=high_body)
                idle_b, failed_b = await high_series(high, fleet.port, high_samples, spacing, body=high_body)
            else:
                (idle_a, idle_b), failed_a, failed_b = idle_from["idle_series_s"], 0, 0
            idle, idle_failed = idle_a + idle_b, failed_a + failed_b
            cap = at_least * 1.2 * percentile(idle, 95) if at_least else None
            low_wires = [wire(port, low_body, "low") for port in fleet.ports]
            stop_at = time.monotonic() + backlog + high_samples * spacing + 120.0
            stopping = asyncio.Event()

            # Replicas: the flood goes to the first until its engines' batches are learned
            # (learned_batches), then over all of them.
            spread = [1 if replicas > 1 and policy != "static" else len(low_clients)]

            async def low_worker(i: int) -> None:
                while not stopping.is_set() and time.monotonic() < stop_at:
                    k = i % spread[0]
                    r = await low_clients[k].send(i, low_wires[k])
                    if r.ok:
                        counts["ok"] += 1
                    elif r.status in (429, 503):  # declined: back off as told (Retry-After)
                        counts["declined"] += 1
                        await asyncio.sleep(min(backoff_cap, 1.0))
                    else:
                        counts["failed"] += 1
                        await asyncio.sleep(0.1)

            workers = [asyncio.create_task(low_worker(i)) for i in range(low)]
            try:
                if at is not None:
                    await asyncio.sleep(at)
                    before = {}
                elif policy == "static":
                    before = await flooded(fleet, backlog)
                else:
                    await asyncio.sleep(backlog)
                    if spread[0] < len(low_clients):
                        await learned_batches(fleet, settle_timeout)
                        spread[0] = len(low_clients)
                        await asyncio.sleep(backlog)
                    before = await settled(fleet, settle_timeout)
                done_before = counts["ok"]
                t0 = time.monotonic()
                loaded, loaded_failed = await high_series(high, fleet.port, high_samples, spacing, cap, body=high_body)
                window = time.monotonic() - t0
                after = await fleet.stats()
                low_done = counts["ok"] - done_before
            finally:
                stopping.set()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        finally:
            high.close()
            for c in low_clients:
                c.close()
    finally:
        fleet.stop()
    adm = (before or after).get("admission", {})
    return {
        "policy": policy,
        "engines": [" ".join(a) for a in engine_args],
        "idle_ms": {
            "p50": percentile(idle, 50) * 1000,
            "p95": percentile(idle, 95) * 1000,
            "p99": percentile(idle, 99) * 1000,
            "n": len(idle),
            "failed": idle_failed,
        },
        "loaded_ms": {
            "p50": percentile(loaded, 50) * 1000,
            "p95": percentile(loaded, 95) * 1000,
            "p99": percentile(loaded, 99) * 1000,
            "n": len(loaded),
            "failed": loaded_failed,
            "capped": sum(1 for x in loaded if x == cap),
        },
        "idle_series_s": [idle_a, idle_b],
        "p95_ratio": percentile(loaded, 95) / percentile(idle, 95),
        "noise": noise(idle_a, idle_b),
        "p99_ratio": percentile(loaded, 99) / percentile(idle, 99),
        "low": {"completed_during_high_series": low_done, "rps": low_done / window if window > 0 else None, **counts},
        "gateway_queued": adm.get("queued"),
        "inflight": sum(e.get("inflight", 0) for e in adm.get("endpoints", {}).values()),
        "batch_capacity": {n: e.get("batch_capacity") for n, e in adm.get("endpoints", {}).items()},
        "limits": adm.get("limits"),
        "high_wait_ms": after.get("admission", {}).get("bands", {}).get("high", {}).get("wait_ms"),
    }


async def matrix(scenarios: dict[str, list[list[str]]], policies: list[str], log_dir: str, **kw) -> list[dict]:
    """Every scenario under every policy, one after another (the machine is shared)."""
    out = []
    for name, engines in scenarios.items():
        for policy in policies:
            res = await run(engines, policy, log_dir, **kw)
            res["scenario"] = name
            out.append(res)
            print(
                f"  {name:<11} {policy:<8} high p95 idle {res['idle_ms']['p95']:6.0f} ms, loaded "
                f"{res['loaded_ms']['p95']:7.0f} ms: {res['p95_ratio']:6.2f}x  (low in flight "
                f"{res['inflight']}, queued {res['gateway_queued']}, low ok {res['low']['ok']}, "
                f"declined {res['low']['declined']}; batch {res['batch_capacity']})",
                file=sys.stderr,
                flush=True,
            )
    return out
