"""`normal` work arriving into a flood of `low` work on engines whose batch their KV cache
bounds, at default flags.

Two sim engines of 256 blocks (``KV_BOUND_LONG``), `velocityllm serve --policy dynamic`
in front of them, 300 `low` clients each keeping a 200-token request in flight (waiting
what Retry-After says when declined) and a short `high` streaming request every 0.1 s
from the start. Admission paces low work at its share of each cache (0.8 of 95 %: 0.76);
while no `normal` request has arrived for `admission.borrow_after_ms` (60 s), low work's
projected KV peak may pass that share, up to 95 % of the cache (admission/controller.pyx,
``_peak_cap``). 10 s into the flood a `normal` request (the same short body as high's)
arrives every 0.2 s. The first ends the borrowing, but normal's own KV term stops it at
0.8 of the cache: normal work that arrives while low's peak is past that could wait, up to
an answer's time, until the cache has drained.

Asserted: before normal arrives `/stats` shows the condition really exercised
(``batch_peak_past_share`` True, some engine's ``kv_peak`` past 0.76), and after it the
share holds again (False). Normal p95 over its first 2 s and over the rest are each
within 1.5x of its idle p95 (times the run's own idle noise, as the isolation matrix
judges: at most 2.25x), every normal request is answered 200, high p95 keeps the same
bound against its own idle figure, and the low work completed at a rate that shows the
engines busy. The idle series run on the same gateway once the flood has drained (two
of each band, their p95s apart by the machine's noise): one before the flood would count
as a normal request and keep the condition from being exercised. A run past the bound is
run once more and the better one judged: noise only ever makes a run worse, and normal
held behind the cache would be past it in both. Then `static` (one FIFO, its idle figure
the dynamic run's) under the same flood: normal p95 at least 5x idle, so the load is real.

Measured here: normal p95 202-207 ms over its first 2 s and 202-206 ms after, high's
203-205 ms, against 164 ms idle (1.23-1.26x, high 1.24-1.25x); low 9.5-9.6 requests a
second; low's projected peak past its share before normal arrived (0.84-0.92 of the
cache); `static` past 5x (its cap). The same beside a process that keeps a core busy.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from velocity_fast.loadgen.client import Client, frozen_heap
from velocity_fast.loadgen.isolation import (
    KV_BOUND_LONG,
    LONG,
    Fleet,
    flooded,
    high_series,
    noise,
    percentile,
    poll_stats,
    wire,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timed]  # latency ratios and a throughput floor

LOW_CLIENTS = 300
FLOOD_S = 24.0  # the whole flood, from the first low request
NORMAL_AT = 10.0  # the first normal request, seconds into the flood
NORMAL_EVERY = 0.2
HIGH_EVERY = 0.1
FIRST_S = 2.0  # normal's first seconds, judged apart from the rest
LOW_SHARE = 0.76  # low's share of the cache: its ceiling 0.8 of the 95 % margin
TARGET = 1.5
# Low completions a second over the flood once the caches have filled (from LOW_FROM s):
# 9.5-9.6 on a 2-core machine; half of that, or the engines were not busy.
LOW_FROM = 5.0
LOW_RPS_FLOOR = 5.0
STATIC_AT_LEAST = 5.0


def bound(idle_a: list[float], idle_b: list[float]) -> float:
    """1.5x, times the run's own idle noise up to 1.5 of it (at most 2.25x in all), as
    tests/e2e/test_isolation_matrix.py judges."""
    return TARGET * min(noise(idle_a, idle_b), 1.5)


async def series(
    client: Client, port: int, band: str, n: int, spacing: float, cap: float | None = None
) -> tuple[list[float], int]:
    """n requests of LONG's short streaming body in ``band``, one every ``spacing`` s:
    (latencies of the ok ones, failures); ``cap`` as high_series takes it."""
    return await high_series(client, port, n, spacing, cap, body=LONG["high_body"], band=band)


def _admission(st: dict) -> dict:
    return st.get("admission", {})


def _drained(_last, now: dict) -> bool:
    """Nothing in flight nor queued at the gateway, and the engines' own gauges show
    nothing running or waiting (a low request given up may finish there)."""
    adm = _admission(now)
    eps = adm.get("endpoints", {})
    engines = now.get("endpoints", [])
    return (
        bool(eps)
        and bool(engines)
        and not adm.get("queued")
        and all(e.get("inflight", 0) == 0 for e in eps.values())
        and all(not e.get("running") and not e.get("waiting") for e in engines)
    )


async def kv_flood(log_dir: str) -> dict:
    """The dynamic run: the flood with high and then normal work in it, the /stats read
    throughout, and the idle series once the flood has drained."""
    fleet = Fleet(KV_BOUND_LONG, "dynamic", log_dir, sim_base=LONG["sim_base"])
    fleet.start()
    try:
        await fleet.wait_ready()
        low = Client("127.0.0.1", fleet.port, timeout=300)
        high = Client("127.0.0.1", fleet.port, timeout=300)
        normal = Client("127.0.0.1", fleet.port, timeout=300)
        try:
            ldata = wire(fleet.port, LONG["low_body"], "low")
            hdata = wire(fleet.port, LONG["high_body"], "high")
            ndata = wire(fleet.port, LONG["high_body"], "normal")
            low_done: list[float] = []
            counts = {"declined": 0, "failed": 0}
            # (index, sent, latency or None, status), the index its place in the series.
            highs: list[tuple[int, float, float | None, int]] = []
            normals: list[tuple[int, float, float | None, int]] = []
            samples: list[tuple[float, float, bool | None, dict]] = []
            first_normal_back: list[float] = []
            t0 = time.perf_counter()
            stop_at = t0 + FLOOD_S

            async def low_worker(i: int) -> None:
                while time.perf_counter() < stop_at:
                    r = await low.send(i, ldata)
                    if r.ok:
                        low_done.append(r.done - t0)
                    elif r.status in (429, 503):  # declined: back off as told
                        counts["declined"] += 1
                        await asyncio.sleep(min(r.retry_after if r.retry_after is not None else 0.5, 2.0))
                    else:
                        counts["failed"] += 1
                        await asyncio.sleep(0.1)

            async def timed(client: Client, i: int, data: bytes, into: list) -> None:
                r = await client.send(i, data)
                into.append((i, r.sent - t0, (r.done - r.sent) if r.ok else None, r.status))
                if into is normals and not first_normal_back:
                    first_normal_back.append(r.done - t0)

            async def open_loop(client: Client, data: bytes, start: float, every: float, into: list) -> None:
                # One request every ``every`` s from ``start``, each on its own: none waits
                # for the one before.
                sent = []
                i = 0
                while (at := t0 + start + i * every) < stop_at:
                    await asyncio.sleep(max(0.0, at - time.perf_counter()))
                    sent.append(asyncio.create_task(timed(client, i, data, into)))
                    i += 1
                await asyncio.gather(*sent)

            async def sampler() -> None:
                while time.perf_counter() < stop_at:
                    a = time.perf_counter() - t0
                    adm = _admission(await fleet.stats())
                    b = time.perf_counter() - t0
                    pool = adm.get("pools", {}).get(LONG["high_body"]["model"], {})
                    peaks = {n: e.get("kv_peak") for n, e in adm.get("endpoints", {}).items()}
                    samples.append((a, b, pool.get("batch_peak_past_share"), peaks))
                    await asyncio.sleep(0.25 if a < NORMAL_AT + 1.0 else 0.5)

            workers = [asyncio.create_task(low_worker(i)) for i in range(LOW_CLIENTS)]
            watch = asyncio.create_task(sampler())
            try:
                await asyncio.gather(
                    open_loop(high, hdata, 0.0, HIGH_EVERY, highs),
                    open_loop(normal, ndata, NORMAL_AT, NORMAL_EVERY, normals),
                )
                await watch
            finally:
                for w in [*workers, watch]:
                    w.cancel()
                await asyncio.gather(*workers, watch, return_exceptions=True)
                low.close()
            # The low requests given up leave the gateway with their connections; those
            # on the engines finish there. Nothing in flight, nothing queued: idle.
            drained_from = time.perf_counter()
            drained = _drained(None, await poll_stats(fleet, 30.0, _drained, 0.2))
            drain_s = time.perf_counter() - drained_from
            await series(normal, fleet.port, "normal", 4, 0.05)  # warm
            idle_na, fna = await series(normal, fleet.port, "normal", 20, 0.1)
            idle_ha, fha = await series(high, fleet.port, "high", 20, 0.1)
            idle_nb, fnb = await series(normal, fleet.port, "normal", 20, 0.1)
            idle_hb, fhb = await series(high, fleet.port, "high", 20, 0.1)
        finally:
            high.close()
            normal.close()
    finally:
        fleet.stop()
    return {
        "low_done": low_done,
        "counts": counts,
        "highs": highs,
        "normals": normals,
        "samples": samples,
        "first_normal_back": first_normal_back[0] if first_normal_back else None,
        "drained": drained,
        "drain_s": drain_s,
        "idle_normal": (idle_na, idle_nb),
        "idle_high": (idle_ha, idle_hb),
        "idle_failed": fna + fha + fnb + fhb,
    }


async def static_normal(log_dir: str, idle_p95: float) -> tuple[list[float], list[int], float]:
    """`static` under the same flood: a normal series once the gateway's FIFO holds low
    work, a request unanswered at 1.2x the verdict's ratio of the dynamic run's idle p95
    counting as that long."""
    fleet = Fleet(KV_BOUND_LONG, "static", log_dir, sim_base=LONG["sim_base"])
    fleet.start()
    try:
        await fleet.wait_ready()
        low = Client("127.0.0.1", fleet.port, timeout=300)
        normal = Client("127.0.0.1", fleet.port, timeout=300)
        try:
            ldata = wire(fleet.port, LONG["low_body"], "low")
            stopping = asyncio.Event()

            async def low_worker(i: int) -> None:
                while not stopping.is_set():
                    r = await low.send(i, ldata)
                    if not r.ok:
                        await asyncio.sleep(min(r.retry_after if r.retry_after is not None else 0.5, 2.0))

            workers = [asyncio.create_task(low_worker(i)) for i in range(LOW_CLIENTS)]
            try:
                await flooded(fleet, 10.0)
                cap = STATIC_AT_LEAST * 1.2 * idle_p95
                lat, bad = await series(normal, fleet.port, "normal", 10, NORMAL_EVERY, cap)
            finally:
                stopping.set()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        finally:
            low.close()
            normal.close()
    finally:
        fleet.stop()
    return lat, bad, cap


def _ms(xs: list[float], q: float = 95) -> float:
    return percentile(xs, q) * 1000 if xs else float("nan")


def judge(r: dict) -> dict:
    """A dynamic run's figures: normal's first seconds and the rest, high, each against
    its own idle p95; low's rate; what /stats showed before and after normal arrived."""
    idle_na, idle_nb = r["idle_normal"]
    idle_ha, idle_hb = r["idle_high"]
    n_first = round(FIRST_S / NORMAL_EVERY)
    normals, highs, samples = r["normals"], r["highs"], r["samples"]
    first = [lat for i, _, lat, _ in normals if i < n_first and lat is not None]
    rest = [lat for i, _, lat, _ in normals if i >= n_first and lat is not None]
    high = [lat for *_, lat, _ in highs if lat is not None]
    idle_np95 = percentile(idle_na + idle_nb, 95) if idle_na + idle_nb else float("nan")
    idle_hp95 = percentile(idle_ha + idle_hb, 95) if idle_ha + idle_hb else float("nan")
    back = r["first_normal_back"]
    before = [x for x in samples if x[1] < NORMAL_AT]  # answered before the first normal was sent
    after = [x for x in samples if back is not None and x[0] > back]  # asked after one was answered

    def peak(xs):
        return max((p for *_, peaks in xs for p in peaks.values() if p is not None), default=None)

    j = {
        "first": first,
        "rest": rest,
        "high": high,
        "normal_not_ok": [st for *_, lat, st in normals if lat is None],
        "high_not_ok": [st for *_, lat, st in highs if lat is None],
        "idle_np95": idle_np95,
        "idle_hp95": idle_hp95,
        "normal_bound": bound(idle_na, idle_nb),
        "high_bound": bound(idle_ha, idle_hb),
        "normal_noise": noise(idle_na, idle_nb),
        "ratios": {
            "normal first 2 s": percentile(first, 95) / idle_np95 if first else float("inf"),
            "normal after": percentile(rest, 95) / idle_np95 if rest else float("inf"),
            "high": percentile(high, 95) / idle_hp95 if high else float("inf"),
        },
        "low_rps": sum(LOW_FROM <= t <= FLOOD_S for t in r["low_done"]) / (FLOOD_S - LOW_FROM),
        "before": before,
        "after": after,
        "past_before": [x[2] for x in before],
        "peak_before": peak(before),
        "peak_after": peak(after),
        # Once the low work bound before normal arrived has ended (an answer is about 5 s).
        "peak_late": peak([x for x in after if x[0] > back + 6.0]),
    }
    rs = j["ratios"]
    j["worst"] = max(
        rs["normal first 2 s"] / j["normal_bound"], rs["normal after"] / j["normal_bound"], rs["high"] / j["high_bound"]
    )
    return j


def report(j: dict, r: dict) -> str:
    return (
        f"normal p95 first {FIRST_S:.0f} s {_ms(j['first']):.0f} ms (n={len(j['first'])}), after "
        f"{_ms(j['rest']):.0f} ms (n={len(j['rest'])}); idle normal p95 {j['idle_np95'] * 1000:.0f} ms "
        f"(noise {j['normal_noise']:.2f}, bound {j['normal_bound']:.2f}x); high p95 {_ms(j['high']):.0f} ms, idle "
        f"{j['idle_hp95'] * 1000:.0f} ms (bound {j['high_bound']:.2f}x); "
        + ", ".join(f"{k} {v:.2f}x" for k, v in j["ratios"].items())
        + f"\n  low {j['low_rps']:.2f}/s over {LOW_FROM:.0f}-{FLOOD_S:.0f} s ({r['counts']}); kv_peak max before "
        f"normal {j['peak_before']}, after {j['peak_after']} (from 6 s after: {j['peak_late']}); "
        f"batch_peak_past_share before {sorted(set(map(str, j['past_before'])))}, after "
        f"{sorted(set(str(x[2]) for x in j['after']))} ({len(j['after'])} samples); drained in {r['drain_s']:.1f} s"
    )


@pytest.mark.timeout(240)
async def test_normal_work_arriving_into_a_kv_bound_flood_keeps_its_latency(tmp_path):
    with frozen_heap():
        r = await kv_flood(str(tmp_path))
        j = judge(r)
        print(f"\nkv-bound flood, normal from {NORMAL_AT:.0f} s: {report(j, r)}")
        if j["worst"] > 1.0:
            # The machine's noise only ever makes a run worse: the better of two (as the
            # isolation matrix takes the best of its runs). Normal made to wait behind the
            # cache is past the bound in both.
            again = await kv_flood(str(tmp_path))
            ja = judge(again)
            print(f"again: {report(ja, again)}")
            if ja["worst"] < j["worst"]:
                r, j = again, ja
        sta, sta_bad, cap = await static_normal(str(tmp_path), j["idle_np95"])
    static_ratio = percentile(sta, 95) / j["idle_np95"] if sta else float("inf")
    print(
        f"static: normal p95 {_ms(sta):.0f} ms, {static_ratio:.1f}x idle (cap {cap * 1000:.0f} ms, "
        f"{sum(1 for x in sta if x == cap)} capped, not ok {sta_bad})"
    )

    # The condition was exercised: low's peak allowed past its share, and past it.
    assert any(p is True for p in j["past_before"]), j["past_before"]
    assert j["peak_before"] is not None and j["peak_before"] > LOW_SHARE, (j["peak_before"], j["before"])
    # The first normal request ends it.
    assert j["after"] and all(x[2] is False for x in j["after"]), j["after"]
    # Normal has room: none declined, none failed; nor any high request.
    assert r["normals"] and not j["normal_not_ok"], j["normal_not_ok"]
    assert not j["high_not_ok"], j["high_not_ok"]
    assert r["drained"] and r["idle_failed"] == 0, (r["drained"], r["idle_failed"])
    # The load was real.
    assert r["counts"]["failed"] == 0, r["counts"]
    assert j["low_rps"] >= LOW_RPS_FLOOR, j["low_rps"]
    assert static_ratio >= STATIC_AT_LEAST, f"static only {static_ratio:.2f}x: the load is not real"
    # Normal keeps its latency, on its arrival and after; high keeps its isolation.
    rs = j["ratios"]
    assert rs["normal first 2 s"] <= j["normal_bound"], (rs, j["normal_bound"])
    assert rs["normal after"] <= j["normal_bound"], (rs, j["normal_bound"])
    assert rs["high"] <= j["high_bound"], (rs, j["high_bound"])
