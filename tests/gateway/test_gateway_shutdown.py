"""Gateway.stop past the grace, in process: what the clients see and how the requests are
counted (a shutdown is no client cancelling). The SIGTERM path end to end is in
tests/e2e/test_shutdown_e2e.py."""
from __future__ import annotations

import asyncio
import json

from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import http_request, open_request, sim_engine

MODEL = "m1"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 400}
MESSAGE = "The gateway shut down before the response was complete."


def _samples(gw) -> dict:
    out = {}
    for fam in text_string_to_metric_families(gw.registry.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_stop_past_the_grace_ends_each_request_for_its_client_and_counts_it_as_failed():
    # 20 tokens a second: the stream and the whole answer outlive a 0.5 s grace; the queued
    # request (max_concurrency 2) never reaches the engine.
    with sim_engine("--decode-tps", "20", model=MODEL) as eng:
        async with running_gateway(eng, max_concurrency=2, policy="static") as gw:
            stream = await open_request(gw.port, "POST", "/v1/chat/completions", dict(LONG, stream=True))
            try:
                events = stream.events()
                await events.__anext__()
                whole = asyncio.create_task(http_request(gw.port, "POST", "/v1/chat/completions", LONG))
                queued = asyncio.create_task(http_request(gw.port, "POST", "/v1/completions",
                                                          {"model": MODEL, "prompt": "x", "max_tokens": 5}))
                await wait_until(lambda: gw.client_server.requests == 3, 10.0, what="3 requests in flight")
                assert gw.admission.stats()["queued"] == 1
                stopping = asyncio.create_task(gw.stop(grace=0.5))
                rest = [e async for e in events]
                assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["message"] == MESSAGE
                for task in (whole, queued):
                    r = await task
                    assert r.status == 503 and json.loads(r.body)["error"]["message"] == MESSAGE
                await asyncio.wait_for(stopping, 10)
            finally:
                stream.abort()
            counts = gw.admission.telemetry.counts()
            # (the queued one is admitted too when a lease cut before it frees its slot first)
            assert counts["admitted"] in (2, 3) and counts["failed"] == counts["admitted"], counts
            assert counts["completed"] == 0 and counts["cancelled"] == 0, counts
            m = _samples(gw)
            req = {(dict(k)["route"], dict(k)["status"]): v for (name, k), v in m.items()
                   if name == "velocity_requests_total"}
            assert req == {("/v1/chat/completions", "200"): 1.0, ("/v1/chat/completions", "503"): 1.0,
                           ("/v1/completions", "503"): 1.0}, req
            assert gw.client_server.cut == 3
