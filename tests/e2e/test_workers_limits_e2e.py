"""Two workers, one gateway: the limits hold across them (docs/design.md, "Where state lives").

`serve --workers 2 --policy static` in front of two sim engines of 16 sequences, a
concurrency limit of 4 per engine, and a flood of 120 low clients spread over the workers by the kernel
(SO_REUSEPORT). Each engine's own gauges (running + waiting: every request the gateway
has sent it and not yet seen answered) are sampled every 20 ms: they never pass 4, and
they reach 4 (the load was real). Then one worker is killed with SIGKILL: the other
carries on, a new one starts, and the engines fill up to 4 again — the dead worker's
share of the limit was given back, not lost with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.support.procs import stat_fields
from velocity_fast.harness.probe import http_get
from velocity_fast.loadgen.client import Client
from velocity_fast.loadgen.isolation import LOW_BODY, Fleet, wire

pytestmark = [pytest.mark.e2e, pytest.mark.timed]  # latency ratios

LIMIT = 4
ENGINES = [["--max-num-seqs", "16"]] * 2


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the supervisor's workers)."""
    return [child for child, fields in stat_fields() if int(fields[1]) == pid]


async def engine_load(port: int) -> float:
    """running + waiting on one sim engine, from its /metrics."""
    status, body = await http_get("127.0.0.1", port, "/metrics", timeout=2.0)
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(240)
async def test_two_workers_never_pass_an_engines_limit_and_a_dead_ones_share_comes_back(tmp_path):
    # `static`: one band let through up to the limit, so that the flood fills it (under
    # `dynamic` the low band keeps a share of each engine free for higher bands).
    fleet = Fleet(ENGINES, "static", str(tmp_path), workers=2, gateway_args=("--max-concurrency", str(LIMIT)))
    fleet.start()
    try:
        await fleet.wait_ready()
        client = Client("127.0.0.1", fleet.port, timeout=60)
        data = wire(fleet.port, LOW_BODY, "low")
        stop = asyncio.Event()
        results = {"ok": 0, "declined": 0, "failed": 0}

        async def low(i: int) -> None:
            while not stop.is_set():
                r = await client.send(i, data)
                if r.ok:
                    results["ok"] += 1
                elif r.status in (429, 503):
                    results["declined"] += 1
                    await asyncio.sleep(0.2)
                else:
                    results["failed"] += 1
                    await asyncio.sleep(0.05)

        async def sample(seconds: float) -> list[float]:
            peaks = [0.0] * len(fleet.engine_ports)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                loads = await asyncio.gather(*(engine_load(p) for p in fleet.engine_ports))
                peaks = [max(a, b) for a, b in zip(peaks, loads)]
                await asyncio.sleep(0.02)
            return peaks

        tasks = [asyncio.create_task(low(i)) for i in range(120)]
        try:
            await asyncio.sleep(2.0)  # both workers busy, the engines full
            before = await sample(6.0)
            supervisor = fleet.procs[-1].pid
            workers = children(supervisor)
            assert len(workers) == 2, workers
            os.kill(workers[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (len(children(supervisor)) < 2 or workers[0] in children(supervisor)):
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # the new worker takes its share of the flood
            after = await sample(6.0)
        finally:
            # Cancelled, not drained: the queue left behind would take its own time to finish.
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        print(f"\npeaks per engine: before the kill {before}, after {after}; {results}")
        assert max(before) <= LIMIT and max(after) <= LIMIT, (before, after)
        assert max(before) == LIMIT, f"the engines never reached the limit: {before}"
        # The dead worker's requests were given back: the engines run the whole limit again.
        assert max(after) == LIMIT, f"after the kill the engines stayed below the limit: {after}"
        assert results["ok"] > 50
        status, body = await http_get("127.0.0.1", fleet.admin_port, "/metrics", timeout=5.0)
        assert status == 200 and b"velocity_worker_restarts_total 1" in body
    finally:
        fleet.stop()


@pytest.mark.timeout(300)
async def test_isolation_holds_at_default_flags_with_two_workers(tmp_path):
    """The isolation e2e (tests/e2e/test_isolation_matrix.py, seqs-16) through `serve
    --workers 2`: the low flood and the high series are spread over both workers by the
    kernel, and the band ceilings hold across them."""
    from velocity_fast.loadgen.isolation import SCENARIOS, run, static_verdict

    # The matrix's, with the two-replica case's 300 low clients: split over two workers'
    # FIFOs, 200 left static's high p95 as close as 10.6x to its 10x floor here.
    params = dict(low=300, high_samples=30, spacing=0.1, backlog=3.0)

    def bound(r: dict) -> float:  # the matrix's: 1.5x, widened by the run's idle noise (at most 2.25x)
        return 1.5 * min(r["noise"], 1.5)

    dyn = await run(SCENARIOS["seqs-16"], "dynamic", str(tmp_path), workers=2, **params)
    if dyn["p95_ratio"] > bound(dyn):  # the one retry the matrix allows, for the same reason
        again = await run(SCENARIOS["seqs-16"], "dynamic", str(tmp_path), workers=2, **params)
        dyn = min(dyn, again, key=lambda r: r["p95_ratio"] / bound(r))
    sta = await run(SCENARIOS["seqs-16"], "static", str(tmp_path), workers=2, **params, **static_verdict(dyn))
    print(
        f"\n2 workers, seqs-16: dynamic {dyn['p95_ratio']:.2f}x (bound {bound(dyn):.2f}x, "
        f"{dyn['idle_ms']['p95']:.0f} -> {dyn['loaded_ms']['p95']:.0f} ms), static {sta['p95_ratio']:.2f}x"
    )
    assert dyn["idle_ms"]["failed"] == dyn["loaded_ms"]["failed"] == 0
    assert dyn["low"]["completed_during_high_series"] > 0 and sta["low"]["completed_during_high_series"] > 0
    assert dyn["p95_ratio"] <= bound(dyn), dyn
    assert sta["p95_ratio"] >= 10.0, f"static only {sta['p95_ratio']:.2f}x: the load is not real"
