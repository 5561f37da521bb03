"""SIGTERM tells the clients (docs/operations.md, "Shutdown"): `velocityllm serve` in front
of a slow sim engine logs the drain with the requests in flight, refuses new connections
and answers /ready 503 from its start, and ends what outlives `server.shutdown_grace_s`
as an engine death mid-stream is relayed: a stream gets vLLM's error event and [DONE],
a request with nothing sent yet a 503."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from tests.support.gateway import gateway_process
from tests.support.sim import http_request, open_request, sim_engine

GRACE_S = 2.0
# 20 tokens a second: 400 tokens take 20 s, far past the grace.
LONG = {"model": "m1", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400}


async def _ready(admin_port: int) -> tuple[int, dict]:
    r = await http_request(admin_port, "GET", "/ready", timeout=2.0)
    return r.status, json.loads(r.body)


@pytest.mark.timeout(90)
async def test_sigterm_past_the_grace_ends_a_stream_with_an_error_event_and_done(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"server: {{shutdown_grace_s: {GRACE_S}}}\nhealth: {{check_interval_ms: 100}}\n")
    with (
        sim_engine("--decode-tps", "20", model="m1") as eng,
        gateway_process("serve", "--config", str(cfg), "--endpoint", f"e1={eng.url}=m1") as gp,
    ):
        deadline = time.monotonic() + 20
        while (await _ready(gp.admin_port))[0] != 200:
            assert time.monotonic() < deadline, "the gateway did not become ready"
            await asyncio.sleep(0.05)

        stream = await open_request(gp.port, "POST", "/v1/chat/completions", dict(LONG, stream=True))
        try:
            assert stream.status == 200 and stream.headers["content-type"].startswith("text/event-stream")
            events = stream.events()
            first = [await events.__anext__() for _ in range(2)]  # the stream runs
            whole = asyncio.create_task(http_request(gp.port, "POST", "/v1/chat/completions", LONG, timeout=30))
            deadline = time.monotonic() + 10
            while True:  # the whole-answer request is in flight at the gateway
                stats = json.loads((await http_request(gp.admin_port, "GET", "/stats")).body)
                if stats["endpoints"][0]["inflight"] == 2:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)

            gp.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            # From the start of the drain: /ready is 503 (the admin port stays up), and the
            # client port takes no new connection.
            while True:
                status, body = await _ready(gp.admin_port)
                if status == 503:
                    break
                assert time.monotonic() - t0 < GRACE_S / 2, "/ready still 200 well into the drain"
                await asyncio.sleep(0.01)
            assert body["ready"] is False and body["draining"] is True
            with pytest.raises(OSError):
                await asyncio.wait_for(asyncio.open_connection("127.0.0.1", gp.port), 2.0)
            drained_at = time.monotonic() - t0
            assert drained_at < GRACE_S / 2
            status, _ = await _ready(gp.admin_port)
            assert status == 503  # and it stays so

            # The stream goes on until the grace ends, then: the error event, [DONE], its end.
            rest = [e async for e in events]
            cut_after = time.monotonic() - t0
            assert GRACE_S * 0.8 < cut_after < GRACE_S + 5, cut_after
            assert rest[-1] == "[DONE]"
            assert json.loads(rest[-2]) == {
                "error": {
                    "message": "The gateway shut down before the response was complete.",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            }
            tokens = [json.loads(e) for e in first + rest[:-2]]
            assert len(tokens) > 2 and all("choices" in t for t in tokens)  # it kept streaming meanwhile
        finally:
            stream.abort()

        # Nothing was sent of the whole answer: a 503 in the error shape.
        r = await whole
        assert r.status == 503
        assert json.loads(r.body)["error"]["message"] == "The gateway shut down before the response was complete."

        assert gp.wait(15) == 0
        log = gp.stderr_text
        assert (
            f"shutting down: 2 request(s) in flight, grace {GRACE_S:g} s; new connections refused, /ready 503"
        ) in log, log
        assert f"shutdown grace of {GRACE_S:g} s over: 2 response(s) still running ended with an error" in log, log
