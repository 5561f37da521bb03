"""Priority isolation through admission alone, against in-process fake engines.

A fake engine serves each request in a fixed time stretched by its batch size (as
continuous batching does); a tiny router picks the endpoint with room and the
fewest in flight. With a continuous flood of long low requests, short high ones
must stay near their idle latency under ``dynamic`` and be far worse under
``static`` (so the test fails if admission regresses and also if the load stops
being real). Durations are bounded; assertions are wide ratios.
"""

import asyncio
import time

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.errors import Rejected
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.fleet.endpoint import Endpoint, Pool

HIGH_S = 0.01
LOW_S = 0.1
CONTENTION = 0.02
LOW_CLIENTS = 120


class FakeEngine:
    """Continuous batching in one number: service time grows with the batch."""

    def __init__(self):
        self.running = 0

    async def serve(self, seconds):
        self.running += 1
        try:
            await asyncio.sleep(seconds * (1 + CONTENTION * (self.running - 1)))
        finally:
            self.running -= 1


def pick(adm, pool):
    ok = [e for e in pool.endpoints if adm.has_room(e)]
    return min(ok, key=lambda e: e.inflight) if ok else None


async def one(adm, pool, engines, band, seconds):
    t0 = time.monotonic()
    lease = await adm.admit(Ticket(band=band, max_tokens=10))  # one tenant: no help from fairness
    try:
        ep = pick(adm, pool)
        assert ep is not None, "a lease was granted with no endpoint that has room"
        lease.bind(ep)
        await engines[ep.name].serve(seconds)
        lease.first_byte()
        lease.release("completed", tokens=10)
    except BaseException:
        lease.release("cancelled")
        raise
    return time.monotonic() - t0


async def high_p99(policy, with_load, duration=1.0):
    eps = [Endpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}", "m") for i in range(2)]
    for e in eps:
        e.healthy = True
    pool = Pool("m", eps)
    engines = {e.name: FakeEngine() for e in eps}
    adm = Admission(AdmissionSettings(aimd_max=16, aimd_min=1), {"m": pool}, policy=policy)
    stop = time.monotonic() + duration

    async def low_client():
        while time.monotonic() < stop:
            try:
                await one(adm, pool, engines, "low", LOW_S)
            except Rejected:
                await asyncio.sleep(0.01)

    lows = [asyncio.create_task(low_client()) for _ in range(LOW_CLIENTS if with_load else 0)]
    try:
        await asyncio.sleep(0.3 if with_load else 0)  # let the flood build up
        lat = []

        async def high_client():
            while time.monotonic() < stop and len(lat) < 200:
                lat.append(await one(adm, pool, engines, "high", HIGH_S))
                await asyncio.sleep(0.005)

        await asyncio.gather(*(high_client() for _ in range(4)))
        assert len(lat) >= 5
    finally:
        for t in lows:
            t.cancel()
        await asyncio.gather(*lows, return_exceptions=True)
        adm.close()
    c = adm.stats()["counters"]
    assert c["admitted"] == c["completed"] + c["failed"] + c["cancelled"] + c["in_flight"]
    lat.sort()
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))], adm


@pytest.mark.timeout(60)
async def test_high_stays_near_idle_with_dynamic_and_not_with_static():
    idle, _ = await high_p99("dynamic", with_load=False, duration=0.5)
    dynamic, adm = await high_p99("dynamic", with_load=True)
    static, _ = await high_p99("static", with_load=True)
    # The load was real: the low band was busy and queued.
    assert adm.stats()["counters"]["completed"] > 100
    assert dynamic < 3.0 * idle, (idle, dynamic, static)
    assert static > 10.0 * idle, (idle, dynamic, static)
    print(
        f"\nhigh p99: idle {idle * 1000:.1f} ms, dynamic {dynamic * 1000:.1f} ms "
        f"({dynamic / idle:.2f}x), static {static * 1000:.1f} ms ({static / idle:.1f}x)"
    )
