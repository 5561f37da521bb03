"""The workers' shared state (state/shm.pyx): two admissions, each as one worker would
run it, in front of the same engines, counting against one segment.

A process is one worker at a time (``attach``); the endpoints, pools and tenants made
after an attach take their slots in the segment by name, so two workers are two sets of
objects made under two attaches. The real processes are in tests/e2e/test_workers_e2e.py.
"""

import asyncio
import multiprocessing
import time

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.gateway.identity import Tenant
from velocity_fast.state.shm import SharedState, attach, attached, detach

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def state(tmp_path):
    s = SharedState.create(str(tmp_path / "shm"), 2)
    yield s
    detach()
    s.unlink()


def worker(state, index, limit=4, n=1, policy="static"):
    """What worker ``index`` makes: its endpoints (same names) and its admission."""
    attach(state, index)
    eps = [Endpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}", "m") for i in range(n)]
    for e in eps:
        e.healthy = True
    adm = Admission(
        AdmissionSettings(aimd_max=limit, aimd_min=1, aimd_initial=0),
        {"m": Pool("m", eps)},
        policy=policy,
        clock=time.monotonic,
    )
    return adm, eps


async def test_in_flight_is_every_workers_and_the_limit_holds_across_them(state):
    adm0, (ep0,) = worker(state, 0)
    adm1, (ep1,) = worker(state, 1)
    leases = []
    for _ in range(3):
        attach(state, 0)
        le = await adm0.admit(Ticket())
        assert le.claim(ep0)
        leases.append(le)
    attach(state, 1)
    le = await adm1.admit(Ticket())
    assert le.claim(ep1)
    leases.append(le)
    # Worker 1 sees worker 0's three: the engine's limit of 4 is reached for both.
    assert adm1.stats()["endpoints"]["e0"]["inflight"] == 4
    assert not adm1.has_room(ep1)
    attach(state, 0)
    assert not adm0.has_room(ep0)
    # A fifth request queues in worker 0 rather than go past the limit.
    task = asyncio.create_task(adm0.admit(Ticket()))
    await asyncio.sleep(0.01)
    assert not task.done()
    assert state.snapshot()["pools"]["m"]["queued"][0] == 1
    # Worker 1 ends its request: worker 0's queued one gets the slot at its next cycle.
    attach(state, 1)
    leases.pop().release("completed")
    attach(state, 0)
    adm0.housekeep()
    got = await asyncio.wait_for(task, 1)
    assert got.claim(ep0)
    assert state.snapshot()["endpoints"]["e0"]["inflight"] == 4
    for le in leases + [got]:
        le.release("completed")
    snap = state.snapshot()
    assert snap["endpoints"]["e0"]["inflight"] == 0 and snap["pools"]["m"]["reserved"] == 0
    adm0.close()
    adm1.close()


async def test_a_grant_past_the_pools_limits_queues_instead(state):
    adm0, (ep0,) = worker(state, 0, limit=1)
    adm1, (ep1,) = worker(state, 1, limit=1)
    attach(state, 0)
    a = await adm0.admit(Ticket())
    attach(state, 1)
    b = adm1.admit_nowait(Ticket(), None)  # granted before worker 0 bound: the pool had room
    attach(state, 0)
    assert a.claim(ep0)
    # Worker 0's grant holds the pool's one lease: worker 1's request queued, not granted.
    assert not hasattr(b, "claim") and not b.waiter.done()
    assert state.snapshot()["endpoints"]["e0"]["inflight"] == 1
    assert state.snapshot()["pools"]["m"]["reserved"] == 1
    assert state.snapshot()["pools"]["m"]["refused"] >= 1  # worker 1's dispatch found it full
    adm1.withdraw(Ticket(), b)
    b.waiter.cancel()
    a.release("completed")
    adm0.close()
    adm1.close()


async def test_reclaim_gives_back_what_a_dead_worker_held(state):
    adm0, (ep0,) = worker(state, 0)
    adm1, (ep1,) = worker(state, 1)
    attach(state, 0)
    held = []
    for _ in range(3):
        le = await adm0.admit(Ticket())
        assert le.claim(ep0)
        held.append(le)
    attach(state, 1)
    assert not adm1.has_room(ep1) or ep1.inflight == 3
    # Worker 0 dies with three requests in flight: the supervisor gives them back.
    assert state.reclaim(0) == {"inflight": 3, "reserved": 3}
    assert adm1.has_room(ep1) and ep1.inflight == 0
    snap = state.snapshot()
    assert snap["lost"] == 3 and snap["endpoints"]["e0"]["inflight"] == 0
    for _ in range(4):
        le = await adm1.admit(Ticket())
        assert le.claim(ep1)
    assert not adm1.has_room(ep1)
    adm0.close()
    adm1.close()


async def test_the_smallest_limit_a_worker_set_holds_for_all(state):
    adm0, (ep0,) = worker(state, 0, limit=6)
    (await adm0.admit(Ticket())).release("completed")  # its first request: it knows the engine
    adm1, (ep1,) = worker(state, 1, limit=3)
    (await adm1.admit(Ticket())).release("completed")
    attach(state, 0)
    assert adm0.has_room(ep0) and ep0.limit == 3
    assert state.snapshot()["endpoints"]["e0"]["limit"] == 3
    state.reclaim(1)  # the worker that set 3 is gone: 6 holds
    assert adm0.has_room(ep0) and ep0.limit == 6
    adm0.close()
    adm1.close()


async def test_a_higher_band_queued_in_another_worker_goes_first(state):
    adm0, (ep0,) = worker(state, 0, limit=1, policy="dynamic")
    adm1, (ep1,) = worker(state, 1, limit=1, policy="dynamic")
    attach(state, 0)
    first = await adm0.admit(Ticket(band="high"))
    assert first.claim(ep0)
    low = asyncio.create_task(adm0.admit(Ticket(band="low")))
    attach(state, 1)
    high = asyncio.create_task(adm1.admit(Ticket(band="high")))
    await asyncio.sleep(0.01)
    assert not low.done() and not high.done()
    # The slot frees in worker 0, whose own queue holds only low work: it leaves the
    # slot to worker 1's high request.
    attach(state, 0)
    first.release("completed")
    await asyncio.sleep(0.01)
    assert not low.done()
    attach(state, 1)
    adm1.housekeep()
    got = await asyncio.wait_for(high, 1)
    assert got.band == "high" and got.claim(ep1)
    got.release("completed")
    attach(state, 0)
    adm0.housekeep()
    (await asyncio.wait_for(low, 1)).release("completed")
    adm0.close()
    adm1.close()


class Cfg:
    def __init__(self, name, rps=None, burst=None, tpm=None):
        self.name, self.requests_per_second, self.burst, self.tokens_per_minute = name, rps, burst, tpm
        self.max_band, self.weight, self.sla_ms = None, 1, None


def test_a_tenants_buckets_are_one_across_workers(state):
    attach(state, 0)
    t0 = Tenant(Cfg("acme", rps=1.0, burst=4.0, tpm=600))
    attach(state, 1)
    t1 = Tenant(Cfg("acme", rps=1.0, burst=4.0, tpm=600))
    took = [t0.take() == 0.0, t1.take() == 0.0, t0.take() == 0.0, t1.take() == 0.0]
    assert all(took)
    # The burst of 4 is spent across both: the fifth waits about a second, in either worker.
    assert 0.5 < t0.take() <= 1.0 and 0.5 < t1.take() <= 1.0
    assert t0.take_tokens(500) == 0.0
    assert t1.take_tokens(500) > 0  # 100 left of 600
    t0.settle_tokens(-400)  # the answer used 100 of its 500
    assert t1.take_tokens(450) == 0.0
    assert t0.tokens_left() == pytest.approx(50, abs=5)


def _hammer(path, index, rounds, start, out):
    from velocity_fast.state.shm import SharedState, attach

    s = SharedState.open(path)
    attach(s, index)
    t = Tenant(Cfg("t", rps=1e-3, burst=float(rounds)))  # no refill to speak of: the burst only
    start.wait(30)
    out.put(sum(t.take() == 0.0 for _ in range(rounds)))


def test_draws_from_two_processes_at_once_never_exceed_the_bucket(state):
    # Each process tries to take the whole burst: together exactly the burst is granted.
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    start = ctx.Barrier(2)
    rounds = 200_000  # a few tenths of a second of draws each: longer than a time slice
    procs = [ctx.Process(target=_hammer, args=(state.path, i, rounds, start, q)) for i in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    assert sum(got) == rounds and all(g > 0 for g in got)


def test_open_refuses_what_is_no_segment(tmp_path):
    bad = tmp_path / "x"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(OSError):
        SharedState.open(str(bad))
    with pytest.raises(OSError):
        SharedState.open(str(tmp_path / "missing"))
    with pytest.raises(ValueError):
        SharedState.create(str(tmp_path / "y"), 0)
    assert attached() is None


def test_a_tenants_fairness_counter_is_one_across_workers(state):
    # Worker 0 serves tenant "a" 10 requests of 100 tokens; worker 1 then queues "b" and
    # "a": "a" has been served already (in the other worker), so "b" goes first until it
    # has caught up. (With a counter per worker, "a" would start level and they would
    # alternate.)
    from velocity_fast.admission.bands import BandQueues

    inf = float("inf")
    attach(state, 0)
    q0 = BandQueues([(0, 0, 0.0)], token_fair=True)
    for i in range(10):
        q0.enqueue(i, "a", 0, 0, 100, inf, 0.0)
    for _ in range(10):
        q0.pop(0, 0.0)
    attach(state, 1)
    q1 = BandQueues([(0, 0, 0.0)], token_fair=True)
    for i in range(10):
        q1.enqueue(("b", i), "b", 0, 0, 100, inf, 0.0)
        q1.enqueue(("a", i), "a", 0, 0, 100, inf, 0.0)
    served = [q1.pop(0, 0.0).tenant for _ in range(10)]
    assert served.count("b") >= 9, served
    snap = q1.tenant_snapshot()[0]
    assert snap["a"][0] == pytest.approx(snap["b"][0], rel=0.15)


def test_a_lift_in_one_worker_leaves_out_another_workers_answers_in_flight(state):
    # Worker 0 dispatched two of heavy's requests (charged 2,000 each, the estimate) and
    # one ended (served 1,232). Worker 1 then sees light arrive: it is lifted to what heavy
    # was served, read from the shared counter less its shared pending part, not to the
    # estimate still in flight in worker 0 (3,232). The lift shows in both workers.
    from velocity_fast.admission.bands import BandQueues

    inf = float("inf")
    attach(state, 0)
    q0 = BandQueues([(0, 0, 0.0)], token_fair=True, weights={"light": 3.0})
    for i in range(4):
        q0.enqueue(i, "heavy", 0, 4800, 400, inf, 0.0)
    first, _ = q0.pop(0, 0.0), q0.pop(0, 0.0)
    q0.settle_tenant(0, "heavy", first.charged, 1232.0)
    attach(state, 1)
    q1 = BandQueues([(0, 0, 0.0)], token_fair=True, weights={"light": 3.0})
    q1.enqueue(("heavy", 0), "heavy", 0, 4800, 400, inf, 0.0)
    q1.enqueue(("light", 0), "light", 0, 280, 48, inf, 0.0)
    counter, queued, pending, lifted = q1.tenant_snapshot()[0]["light"]
    assert counter == pytest.approx(1232.0) and lifted == pytest.approx(1232.0) and pending == 0
    heavy = q1.tenant_snapshot()[0]["heavy"]
    assert heavy[0] == pytest.approx(3232.0) and heavy[2] == pytest.approx(2000.0)
    q0.enqueue(("light", 1), "light", 0, 280, 48, inf, 0.0)  # (worker 0's queue of light, made now)
    assert q0.tenant_snapshot()[0]["light"][3] == pytest.approx(1232.0)


async def test_a_slot_freed_in_one_worker_goes_to_the_oldest_request_of_any(state):
    # Without this a worker whose own answers free the slots refills them from its own
    # queue at once, and another worker's older requests wait for a moment when a slot is
    # free at its tick, which under a flood never comes.
    adm0, (ep0,) = worker(state, 0, limit=1)
    adm1, (ep1,) = worker(state, 1, limit=1)
    attach(state, 0)
    first = await adm0.admit(Ticket())
    assert first.claim(ep0)
    attach(state, 1)
    older = asyncio.create_task(adm1.admit(Ticket()))
    await asyncio.sleep(0.01)
    attach(state, 0)
    younger = asyncio.create_task(adm0.admit(Ticket()))
    await asyncio.sleep(0.01)
    assert not older.done() and not younger.done()
    first.release("completed")  # worker 0's own release: its younger request waits
    await asyncio.sleep(0.01)
    assert not younger.done()
    attach(state, 1)
    adm1.housekeep()
    got = await asyncio.wait_for(older, 1)
    assert got.claim(ep1)
    got.release("completed")
    attach(state, 0)
    adm0.housekeep()
    (await asyncio.wait_for(younger, 1)).release("completed")
    adm0.close()
    adm1.close()
