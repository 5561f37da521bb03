"""Live reload, in process: endpoints added and removed while a stream runs on the one that
goes, a rebuilt admission while requests wait in the old one, and a refused config."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.support.gateway import gateway_settings, running_gateway, wait_until
from tests.support.sim import SimEngine, http_request, open_request, sim_engine
from velocity_fast.config import ConfigError
from velocity_fast.gateway.reload import Reloader


@pytest.fixture(scope="module")
def engines():
    with sim_engine(model="m1", time_scale=10) as e1, sim_engine(model="m1", time_scale=10) as e2:
        yield e1, e2


def _chat(n: int, stream: bool = False) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": "count"}], "max_tokens": n, "stream": stream}


def _settings(*eps: SimEngine | tuple[str, str, str], **keys):
    return gateway_settings(*eps, **keys)


async def test_removed_endpoint_finishes_its_stream_and_new_requests_go_to_the_added_one(engines):
    e1, e2 = engines
    async with running_gateway(("a", e1.url, "m1")) as gw:
        reloader = Reloader(gw, lambda: _settings(("b", e2.url, "m1")))
        try:
            s = await open_request(gw.port, "POST", "/v1/chat/completions", _chat(120, stream=True))
            assert s.status == 200 and s.headers["x-velocity-endpoint"] == "a"
            events = s.events()
            first = await anext(events)
            assert "choices" in first

            assert await reloader.reload()
            assert sorted(gw.endpoints) == ["b"]
            await wait_until(lambda: gw.endpoints["b"].healthy, 5.0, what="b healthy")
            r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(3))
            assert r.status == 200 and r.headers["x-velocity-endpoint"] == "b"

            # The stream on the removed endpoint runs to its end.
            rest = [ev async for ev in events]
            await s.close()
            assert rest[-1] == "[DONE]"
            assert not any("error" in json.loads(ev) for ev in rest[:-1] if ev.startswith("{"))
            tokens = sum(
                len(json.loads(ev)["choices"][0].get("delta", {}).get("content") or "") > 0
                for ev in [first, *rest[:-1]]
                if ev.startswith("{") and json.loads(ev)["choices"]
            )
            assert tokens >= 100
            assert gw.admission.stats()["counters"]["failed"] == 0
        finally:
            reloader.close()


async def test_queued_requests_in_the_old_admission_complete_after_a_rebuild(engines):
    e1, _ = engines
    s = _settings(("a", e1.url, "m1"), policy="static", max_concurrency=1)
    async with running_gateway(settings=s) as gw:
        reloader = Reloader(gw, lambda: _settings(("a", e1.url, "m1"), policy="dynamic", max_concurrency=4))
        try:
            old = gw.admission
            tasks = [
                asyncio.create_task(http_request(gw.port, "POST", "/v1/chat/completions", _chat(40), timeout=30))
                for _ in range(4)
            ]
            await wait_until(lambda: old.stats()["queued"] >= 2, 10.0, what="requests queued")
            assert (await http_request(gw.port, "GET", "/stats")).json()["admission"]["limits"] == {"a": 1}
            assert await reloader.reload()
            assert gw.admission is not old and gw.admission.policy.name == "dynamic"
            late = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(3), timeout=30)
            assert late.status == 200
            # The new max_concurrency is the new controller's limit (static's was 1).
            stats = (await http_request(gw.port, "GET", "/stats")).json()
            assert stats["admission"]["limits"] == {"a": 4}
            results = await asyncio.gather(*tasks)
            assert [r.status for r in results] == [200] * 4
            # The old controller drained and was let go.
            await wait_until(lambda: reloader.draining == 0, 5.0, what="the old admission to drain")
            assert old.stats()["counters"]["completed"] == 4
        finally:
            reloader.close()


async def test_a_refused_config_changes_nothing(engines, caplog):
    e1, _ = engines
    async with running_gateway(("a", e1.url, "m1"), api_key="k1") as gw:

        def bad():
            raise ConfigError("cfg.yaml: bands[1].ceiling: rises above the band before it")

        reloader = Reloader(gw, bad)
        admission, identity, router = gw.admission, gw.identity, gw.router
        with caplog.at_level(logging.ERROR, logger="velocity.reload"):
            assert not await reloader.reload()
        assert (gw.admission, gw.identity, gw.router) == (admission, identity, router)
        lines = [r.getMessage() for r in caplog.records if r.name == "velocity.reload"]
        assert len(lines) == 1 and "refused" in lines[0] and "bands[1].ceiling" in lines[0]
        r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(2), {"authorization": "Bearer k1"})
        assert r.status == 200
        reloader.close()


async def test_tenant_rate_limit_state_survives_an_unrelated_reload(engines):
    e1, _ = engines
    tenants = [{"name": "t", "api_key": "kt", "requests_per_second": 0.001, "burst": 1}]
    async with running_gateway(("a", e1.url, "m1"), tenants=tenants) as gw:
        h = {"authorization": "Bearer kt"}
        assert (await http_request(gw.port, "POST", "/v1/chat/completions", _chat(2), h)).status == 200
        reloader = Reloader(
            gw, lambda: _settings(("a", e1.url, "m1"), tenants=tenants + [{"name": "u", "api_key": "ku"}])
        )
        assert await reloader.reload()
        reloader.close()
        # The bucket t emptied is the same one: a reload is no way around a rate limit.
        r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(2), h)
        assert r.status == 429 and r.headers["x-velocity-reject-reason"] == "rate-limit"
        assert (
            await http_request(gw.port, "POST", "/v1/chat/completions", _chat(2), {"authorization": "Bearer ku"})
        ).status == 200


async def test_an_endpoint_moved_to_another_url_serves_from_the_new_one(engines):
    e1, e2 = engines
    async with running_gateway(("a", e1.url, "m1")) as gw:
        # The pool's only endpoint is replaced and the policy changes in the same reload.
        reloader = Reloader(gw, lambda: _settings(("a", e2.url, "m1"), policy="smart"))
        try:
            assert await reloader.reload()
            assert gw.endpoints["a"].url == e2.url
            await wait_until(lambda: gw.endpoints["a"].healthy, 5.0, what="a healthy again")
            r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(3))
            assert r.status == 200 and r.headers["x-velocity-endpoint"] == "a"
        finally:
            reloader.close()
