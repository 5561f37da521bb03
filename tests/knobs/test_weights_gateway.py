"""Tenant weights through a running gateway and a sim engine: with one request at a time
on the engine and two tenants backlogged, the tenant of weight 2 is served about twice as
often as the tenant of weight 1; a reload that swaps the weights swaps the shares."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.gateway import gateway_settings, running_gateway, wait_until
from tests.support.sim import http_request, sim_engine
from velocity_fast.gateway.reload import Reloader

# Per tenant, queued behind one long request; the first PER_TENANT completions are
# counted while both tenants still have work waiting.
PER_TENANT = 24


def _tenants(heavy: float, light: float) -> list[dict]:
    return [
        {"name": "heavy", "api_key": "k-heavy", "weight": heavy},
        {"name": "light", "api_key": "k-light", "weight": light},
        {"name": "blocker", "api_key": "k-blocker"},
    ]


def _keys(fairness: str, heavy: float, light: float) -> dict:
    # One request in flight per engine, so the queue decides the order of service. The
    # explicit long SLA keeps every request wanted whatever the server's default is.
    return dict(
        policy="dynamic",
        max_concurrency=1,
        sla_ms=600000,
        tenants=_tenants(heavy, light),
        admission={"fairness": fairness, "aimd_min": 1},
    )


async def _chat(port: int, key: str, n: int):
    body = {"model": "m1", "messages": [{"role": "user", "content": "go"}], "max_tokens": n}
    return await http_request(
        port,
        "POST",
        "/v1/chat/completions",
        body,
        {"authorization": f"Bearer {key}", "x-velocity-sla-ms": "600000"},
        timeout=60,
    )


async def _served_order(gw) -> list[str]:
    """Block the engine with one long request, queue PER_TENANT requests of each tenant
    behind it, and return the tenants in the order their requests completed."""
    adm = gw.admission
    blocker = asyncio.create_task(_chat(gw.port, "k-blocker", 3000))
    await wait_until(lambda: adm.stats()["counters"]["in_flight"] == 1, 10.0, what="the blocker in flight")
    order: list[str] = []

    async def one(tenant: str) -> None:
        r = await _chat(gw.port, f"k-{tenant}", 2)
        assert r.status == 200, r.body
        order.append(tenant)

    tasks = []
    for _ in range(PER_TENANT):
        tasks += [asyncio.create_task(one("heavy")), asyncio.create_task(one("light"))]
    await wait_until(lambda: adm.stats()["queued"] == 2 * PER_TENANT, 10.0, what="all requests queued")
    assert adm.stats()["counters"]["in_flight"] == 1  # the blocker still runs: nothing served yet
    await asyncio.gather(blocker, *tasks)
    assert blocker.result().status == 200
    return order


def _share(order: list[str]) -> float:
    first = order[: PER_TENANT + PER_TENANT // 2]  # heavy's backlog lasts this long at 2:1
    return first.count("heavy") / first.count("light")


@pytest.fixture(scope="module")
def engine():
    with sim_engine(model="m1", time_scale=20) as eng:
        yield eng


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fairness", ["rr", "tokens"])
async def test_weight_two_is_served_twice_as_often_as_weight_one(engine, fairness):
    async with running_gateway(engine, **_keys(fairness, 2.0, 1.0)) as gw:
        order = await _served_order(gw)
    assert len(order) == 2 * PER_TENANT
    assert 1.6 <= _share(order) <= 2.5, order


@pytest.mark.timeout(90)
async def test_equal_weights_share_equally(engine):
    async with running_gateway(engine, **_keys("rr", 1.0, 1.0)) as gw:
        order = await _served_order(gw)
    first = order[:PER_TENANT]
    assert 0.7 <= first.count("heavy") / first.count("light") <= 1.4, order


@pytest.mark.timeout(120)
async def test_a_reload_that_swaps_the_weights_swaps_the_shares(engine):
    async with running_gateway(engine, **_keys("rr", 2.0, 1.0)) as gw:
        assert 1.6 <= _share(await _served_order(gw)) <= 2.5
        reloader = Reloader(gw, lambda: gateway_settings(engine, **_keys("rr", 1.0, 2.0)))
        try:
            old = gw.admission
            assert await reloader.reload()
            assert gw.admission is not old
            order = await _served_order(gw)
        finally:
            reloader.close()
    first = order[: PER_TENANT + PER_TENANT // 2]
    assert 1.6 <= first.count("light") / first.count("heavy") <= 2.5, order
