"""How requests end when neither the engine nor the client fails, and how they are counted:
Gateway.stop past the grace, in process (a shutdown is no client cancelling; the SIGTERM
path end to end is in tests/e2e/test_shutdown_e2e.py), and a client that leaves as soon
as a stream's [DONE] came (a completed request)."""

from __future__ import annotations

import asyncio
import json

from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import ScriptedServer, running_gateway, wait_until
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
                queued = asyncio.create_task(
                    http_request(gw.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5})
                )
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
            req = {
                (dict(k)["route"], dict(k)["status"]): v
                for (name, k), v in m.items()
                if name == "velocity_requests_total"
            }
            assert req == {
                ("/v1/chat/completions", "200"): 1.0,
                ("/v1/chat/completions", "503"): 1.0,
                ("/v1/completions", "503"): 1.0,
            }, req
            assert gw.client_server.cut == 3


class LateEndEngine(ScriptedServer):
    """Answers a POST with a short SSE stream whose `data: [DONE]` event comes at once and
    whose end (the last, empty chunk) only ``delay`` seconds later, as vLLM's and the sim
    engine's come in two writes."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            method, _, _, _ = await self.read_request(reader)
            if method != "POST":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(self.delay)
            writer.write(b"0\r\n\r\n")
            await writer.drain()


async def test_a_client_that_leaves_after_done_before_the_engines_end_is_a_completed_request():
    """The openai client closes its connection at `data: [DONE]`; the engine's last chunk
    may come after that. The answer was whole: completed and counted, not cancelled."""
    async with LateEndEngine(delay=0.3) as eng, running_gateway(("e1", eng.url, MODEL)) as gw:
        for _ in range(2):
            stream = await open_request(gw.port, "POST", "/v1/chat/completions", dict(LONG, stream=True))
            try:
                events = [e async for e in _until_done(stream.events())]
                assert events[-1] == "[DONE]"
            finally:
                stream.abort()  # at once, as the openai client does
        await wait_until(lambda: gw.admission.stats()["counters"]["in_flight"] == 0, 5.0, what="books closed")
        counts = gw.admission.telemetry.counts()
        assert counts == {"admitted": 2, "completed": 2, "failed": 0, "cancelled": 0}, counts
        m = _samples(gw)
        req = {dict(k)["status"]: v for (name, k), v in m.items() if name == "velocity_requests_total"}
        assert req == {"200": 2.0}, req


async def _until_done(events):
    async for e in events:
        yield e
        if e == "[DONE]":
            return
