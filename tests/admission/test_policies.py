"""Functional suites every policy object must pass.

Fairness implementations (RoundRobin, TokenWeighted) and ordering implementations
(Fifo, EarliestDeadline) each get one suite, run against the piece alone and
against the queues of each policy (static, dynamic, smart) that uses it.
"""

import asyncio
import math
import random

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.policies import (
    EarliestDeadline,
    EngineSaturation,
    Fifo,
    FixedConcurrency,
    Policy,
    RoundRobin,
    TokenWeighted,
    make_policy,
)
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.fleet.endpoint import Endpoint, Pool

SETTINGS = AdmissionSettings().validate()


def policy_with(fairness=None, ordering=None):
    return Policy(
        "test",
        bands=SETTINGS.bands,
        fairness=fairness or RoundRobin(),
        ordering=ordering or Fifo(),
        saturation=FixedConcurrency(),
        adaptive=False,
        sla_reject=False,
        drop_hopeless=False,
        oom_throttle=False,
        aging_step_s=0.0,
    )


FAIRNESS = [pytest.param(policy_with(fairness=f), id=f"piece-{f.name}") for f in (RoundRobin(), TokenWeighted())]
ORDERING = [pytest.param(policy_with(ordering=o), id=f"piece-{o.name}") for o in (Fifo(), EarliestDeadline())]
NAMED = [pytest.param(name, id=name) for name in ("static", "dynamic", "smart")]
ALL = FAIRNESS + ORDERING + [pytest.param(make_policy(n, SETTINGS), id=n) for n in ("static", "dynamic", "smart")]


def drain(q, now=0.0):
    out = []
    for b in range(q.nbands):
        while (it := q.pop(b, now)) is not None:
            out.append(it)
    return out


# -- fairness suite --------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL)
def test_fairness_heavy_tenant_takes_one_slot_per_rotation(policy):
    q = policy.make_queues(SETTINGS)
    for i in range(500):
        q.enqueue(i, "heavy", 0, 100, 50.0, math.inf, 0.0)
    for i in range(5):
        q.enqueue(i, "light", 0, 100, 50.0, math.inf, 0.0)
    first = [q.pop(0, 0.0).tenant for _ in range(10)]
    assert first.count("light") == 5


@pytest.mark.parametrize("policy", ALL)
def test_fairness_serves_everyone_exactly_once(policy):
    q = policy.make_queues(SETTINGS)
    rng = random.Random(7)
    ids = set()
    for i in range(300):
        rid = q.enqueue(
            i,
            rng.choice("abcdefg"),
            rng.randrange(q.nbands),
            rng.randrange(1000),
            float(rng.randrange(1, 500)),
            rng.choice([math.inf, rng.uniform(0, 100)]),
            i * 0.001,
        )
        assert rid > 0
        ids.add(rid)
    out = [it.id for it in drain(q, 1.0)]
    assert len(out) == len(set(out)) and set(out) == ids and len(q) == 0


@pytest.mark.parametrize("policy", ALL)
def test_fairness_equal_tenants_get_equal_share(policy):
    q = policy.make_queues(SETTINGS)
    for i in range(40):
        for t in "abcd":
            q.enqueue(i, t, 0, 40, 10.0, math.inf, 0.0)
    served = [q.pop(0, 0.0).tenant for _ in range(40)]
    assert all(served.count(t) == 10 for t in "abcd")


@pytest.mark.parametrize("policy", [p for p in FAIRNESS if p.values[0].fairness.token_fair])
def test_token_fairness_bounds_long_request_tenants(policy):
    q = policy.make_queues(SETTINGS)
    for i in range(100):
        q.enqueue(i, "long", 0, 0, 1000.0, math.inf, 0.0)
        q.enqueue(i, "short", 0, 0, 100.0, math.inf, 0.0)
    tokens = {"long": 0.0, "short": 0.0}
    for _ in range(55):
        it = q.pop(0, 0.0)
        tokens[it.tenant] += it.tokens
    assert abs(tokens["long"] - tokens["short"]) <= 1000.0


# -- ordering suite --------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL)
def test_ordering_within_a_tenant_follows_the_policy_key(policy):
    q = policy.make_queues(SETTINGS)
    rng = random.Random(3)
    for i in range(200):
        q.enqueue(i, "solo", 0, 1, 1.0, rng.choice([math.inf, rng.uniform(0, 10)]), i * 0.01)
    out = drain(q, 2.0)
    keys = [policy.ordering.key(it) for it in out]
    assert keys == sorted(keys)


@pytest.mark.parametrize("policy", ALL)
def test_ordering_survives_cancellation(policy):
    q = policy.make_queues(SETTINGS)
    ids = [q.enqueue(i, "solo", 0, 1, 1.0, float(100 - i), float(i)) for i in range(20)]
    for rid in ids[::3]:
        q.cancel(rid)
    out = drain(q, 30.0)
    assert len(out) == 20 - len(ids[::3])
    keys = [policy.ordering.key(it) for it in out]
    assert keys == sorted(keys)


def test_policies_compose_the_design_pieces():
    static, dynamic, smart = (make_policy(n, SETTINGS) for n in ("static", "dynamic", "smart"))
    assert static.single_band and isinstance(static.saturation, FixedConcurrency)
    assert not (static.sla_reject or static.adaptive or static.oom_throttle)
    assert isinstance(dynamic.ordering, Fifo) and isinstance(dynamic.saturation, EngineSaturation)
    assert dynamic.sla_reject and dynamic.adaptive and dynamic.drop_hopeless
    assert isinstance(smart.ordering, EarliestDeadline) and smart.drop_hopeless
    with pytest.raises(ValueError):
        make_policy("fancy", SETTINGS)


# -- the same suites through Admission, per named policy -------------------------


@pytest.mark.parametrize("name", NAMED)
async def test_admission_round_robin_between_tenants(name):
    ep = Endpoint("e0", "http://127.0.0.1:9", "m")
    ep.healthy = True
    adm = Admission(AdmissionSettings(aimd_max=1, aimd_min=1), {"m": Pool("m", [ep])}, policy=name)
    held = await adm.admit(Ticket(band="normal"))
    tasks = [asyncio.create_task(adm.admit(Ticket(band="normal", tenant="heavy"))) for _ in range(30)]
    tasks += [asyncio.create_task(adm.admit(Ticket(band="normal", tenant="light"))) for _ in range(3)]
    await asyncio.sleep(0)
    order = []
    lease = held
    for _ in range(6):
        lease.release("completed")
        await asyncio.sleep(0)
        done = [t for t in tasks if t.done() and t not in order]
        assert len(done) == 1
        order.append(done[0])
        lease = done[0].result()
    lease.release("completed")
    light = tasks[30:]
    assert sum(1 for t in order if t in light) == 3
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
