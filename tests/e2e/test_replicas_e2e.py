"""Active-active replicas: losing one loses only its in-flight requests.

Two `serve` processes in front of the same two sim engines, each carrying half of a
low-band flood (clients behind a load balancer). One replica is killed with SIGKILL
under load. Its clients' requests in flight at that moment fail (the client sees the
connection end); they then go to the surviving replica, as a load balancer sends them,
and are served. The surviving replica's clients see no failure at all, before, during
or after, and the survivor takes over the engine room the dead one held: its learned
view of the other's work (``others``) drains at the next scrapes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.support.gateway import wait_until
from velocity_fast.loadgen.client import Client
from velocity_fast.loadgen.isolation import LOW_BODY, SCENARIOS, Fleet, wire

pytestmark = [pytest.mark.e2e, pytest.mark.timed]  # a delay in seconds


@pytest.mark.timeout(180)
async def test_killing_one_replica_loses_only_its_in_flight_requests(tmp_path):
    fleet = Fleet(SCENARIOS["seqs-16"], "dynamic", str(tmp_path), replicas=2)
    fleet.start()
    try:
        await fleet.wait_ready()
        survivor, victim = fleet.ports
        clients = {p: Client("127.0.0.1", p, timeout=60) for p in fleet.ports}
        wires = {p: wire(p, LOW_BODY, "low") for p in fleet.ports}
        stats = {p: {"ok": 0, "declined": 0, "failed": 0, "ok_after_kill": 0} for p in fleet.ports}
        in_flight = {p: 0 for p in fleet.ports}
        killed_at: list[float] = []
        failed_in_flight_at_kill: list[int] = []
        stop_at = time.monotonic() + 40.0
        stopping = asyncio.Event()

        async def worker(i: int) -> None:
            home = fleet.ports[i % 2]
            while not stopping.is_set() and time.monotonic() < stop_at:
                port = home if not (killed_at and home == victim) else survivor  # the LB moves them
                in_flight[port] += 1
                try:
                    r = await clients[port].send(i, wires[port])
                finally:
                    in_flight[port] -= 1
                s = stats[port]
                if r.ok:
                    s["ok"] += 1
                    if killed_at:
                        s["ok_after_kill"] += 1
                elif r.status in (429, 503):
                    s["declined"] += 1
                    await asyncio.sleep(0.5)
                else:
                    s["failed"] += 1
                    await asyncio.sleep(0.05)

        workers = [asyncio.create_task(worker(i)) for i in range(120)]
        try:
            # Both replicas serving, and the victim with requests in flight to lose.
            await wait_until(
                lambda: stats[survivor]["ok"] > 0 and stats[victim]["ok"] > 0 and in_flight[victim] > 0,
                30.0,
                0.05,
                "both replicas serving",
            )
            assert stats[survivor]["ok"] > 0 and stats[victim]["ok"] > 0, stats
            victim_proc = fleet.procs[-1]  # the second gateway, started last
            failed_in_flight_at_kill.append(in_flight[victim])
            os.killpg(victim_proc.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            # The survivor serves on, the moved clients included, for 3 s at least: long
            # enough for any failure the kill would cause there to show.
            kill = killed_at[0]
            await wait_until(
                lambda: stats[survivor]["ok_after_kill"] > 20 and time.monotonic() - kill >= 3.0,
                30.0,
                0.05,
                "the survivor serving on",
            )
        finally:
            stopping.set()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for c in clients.values():
                c.close()
    finally:
        fleet.stop()
    # Only the requests in flight on the killed replica failed: none on the survivor.
    assert stats[survivor]["failed"] == 0, stats
    assert 0 < stats[victim]["failed"] <= failed_in_flight_at_kill[0], (stats, failed_in_flight_at_kill)
    # The survivor served on, the moved clients included.
    assert stats[survivor]["ok_after_kill"] > 20, stats


@pytest.mark.timeout(120)
async def test_a_replica_sees_the_others_work_within_a_few_scrapes(tmp_path):
    """How stale one replica's view of another's work is: requests sent through the second
    replica show in the first one's ``others`` (admin /stats) once the engines' running
    gauges have been scraped (every 100 ms by default). Measured from the moment the
    requests were sent; bounded at 1 s (the scrape interval, the engines' first step and
    a loaded machine's delays, with room)."""
    import orjson

    from velocity_fast.harness.probe import http_get

    fleet = Fleet(SCENARIOS["seqs-16"], "dynamic", str(tmp_path), replicas=2)
    fleet.start()
    try:
        await fleet.wait_ready()
        first_admin, second = fleet.admin_ports[0], fleet.ports[1]
        client = Client("127.0.0.1", second, timeout=60)
        n = 6
        t0 = time.monotonic()
        sends = [asyncio.create_task(client.send(i, wire(second, LOW_BODY, "low"))) for i in range(n)]
        seen_after = None
        while time.monotonic() - t0 < 5.0:
            status, body = await http_get("127.0.0.1", first_admin, "/stats")
            eps = orjson.loads(body)["admission"]["endpoints"]
            if sum(e["others"] for e in eps.values()) >= n:
                seen_after = time.monotonic() - t0
                break
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*sends)
        client.close()
    finally:
        fleet.stop()
    print(f"\nothers seen after {seen_after}")
    assert all(r.ok for r in results)
    assert seen_after is not None and seen_after <= 1.0, seen_after
