"""Live reload of `velocityllm serve`: SIGHUP re-reads the config file under a steady stream
of requests. A new band and a new tenant key serve new requests, nothing in flight is lost,
and an invalid file is refused in one log line while the old configuration keeps serving."""

from __future__ import annotations

import asyncio
import json
import signal
import time

from tests.support.fakes import free_port_block
from tests.support.gateway import gateway_process, wait_until
from tests.support.sim import http_request, sim_engine

BASE = """
health: {{check_interval_ms: 100, scrape_interval_ms: 50}}
endpoints:
  - {{name: e1, url: "{url}", model: m1}}
bands:
  - {{name: high, ceiling: 1.5}}
  - {{name: normal, ceiling: 1.0}}
  - {{name: low, ceiling: 0.8}}
tenants:
  - {{name: alpha, api_key: key-alpha}}
"""

WITH_URGENT = """
health: {{check_interval_ms: 100, scrape_interval_ms: 50}}
endpoints:
  - {{name: e1, url: "{url}", model: m1}}
bands:
  - {{name: urgent, ceiling: 2.0}}
  - {{name: high, ceiling: 1.5}}
  - {{name: normal, ceiling: 1.0}}
  - {{name: low, ceiling: 0.8}}
tenants:
  - {{name: alpha, api_key: key-alpha}}
  - {{name: beta, api_key: key-beta}}
"""

# Ceilings that rise as priority falls: refused by validation.
INVALID = """
endpoints:
  - {{name: e1, url: "{url}", model: m1}}
bands:
  - {{name: high, ceiling: 1.0}}
  - {{name: low, ceiling: 1.3}}
"""

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 24}


async def _chat(port: int, key: str, band: str | None = None):
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if band:
        headers["x-velocity-priority"] = band
    return await http_request(port, "POST", "/v1/chat/completions", CHAT, headers, timeout=15)


async def _stream(
    port: int, stop: asyncio.Event, statuses: list[int], max_requests: int = 400, deadline_s: float = 40.0
) -> None:
    """Requests back to back with the old key until told to stop (bounded in count and time)."""
    t_end = time.monotonic() + deadline_s
    while not stop.is_set() and len(statuses) < max_requests and time.monotonic() < t_end:
        r = await _chat(port, "key-alpha")
        statuses.append(r.status)


async def test_sighup_adds_band_and_tenant_without_losing_requests(tmp_path):
    cfg = tmp_path / "gateway.yaml"
    with sim_engine(model="m1", time_scale=20) as eng:
        cfg.write_text(BASE.format(url=eng.url))
        with gateway_process("serve", "--config", str(cfg)) as gp:
            port = gp.port
            assert (await _chat(port, "key-beta")).status == 401
            assert (await _chat(port, "key-alpha", "urgent")).status == 400

            stop = asyncio.Event()
            statuses: list[int] = []
            streams = [asyncio.create_task(_stream(port, stop, statuses)) for _ in range(4)]
            try:
                await wait_until(lambda: len(statuses) >= 8, 20.0, what="the stream to flow")

                cfg.write_text(WITH_URGENT.format(url=eng.url))
                gp.proc.send_signal(signal.SIGHUP)
                await wait_until(lambda: "config reloaded" in gp.stderr_text, 10.0, what="the reload log line")
                r = await _chat(port, "key-beta", "urgent")
                assert r.status == 200, r.body
                assert r.headers["x-velocity-band"] == "urgent"
                before = len(statuses)

                cfg.write_text(INVALID.format(url=eng.url))
                gp.proc.send_signal(signal.SIGHUP)
                await wait_until(lambda: "refused" in gp.stderr_text, 10.0, what="the refusal log line")
                refusals = [ln for ln in gp.stderr_text.splitlines() if "refused" in ln]
                assert len(refusals) == 1 and "bands" in refusals[0], gp.stderr_text
                # The configuration in force is still the one with the new band and key.
                r = await _chat(port, "key-beta", "urgent")
                assert r.status == 200 and r.headers["x-velocity-band"] == "urgent"
                await wait_until(lambda: len(statuses) >= before + 8, 20.0, what="the stream to go on")
            finally:
                stop.set()
                await asyncio.gather(*streams)
            assert gp.proc.poll() is None, "the gateway exited"
            assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
            assert "Traceback" not in gp.stderr_text


async def test_chargevelocity_reloads_the_file_and_keeps_the_engines_it_started(tmp_path):
    cfg = tmp_path / "charge.yaml"
    cfg.write_text("tenants:\n  - {name: alpha, api_key: key-alpha}\n")
    base = free_port_block(2)
    with gateway_process(
        "chargeVelocity",
        "--mock",
        "--engines",
        "2",
        "--engine-base-port",
        str(base),
        "--config",
        str(cfg),
        "--sim-args",
        "--time-scale 50",
        timeout=40,
    ) as gp:
        listed: list = []

        async def engines_listed() -> bool:
            # The banner comes once the gateway listens; its first health checks of the
            # engines it started may still be in flight (a loaded machine): /v1/models
            # lists a model once one of its engines has passed one.
            models = await http_request(gp.port, "GET", "/v1/models", headers={"authorization": "Bearer key-alpha"})
            listed[:] = json.loads(models.body)["data"]
            return bool(listed)

        await wait_until(engines_listed, 10.0, interval=0.05, what="the engines' first health check")
        model = listed[0]["id"]
        body = dict(CHAT, model=model)
        beta = {"authorization": "Bearer key-beta", "content-type": "application/json"}
        assert (await http_request(gp.port, "POST", "/v1/chat/completions", body, beta)).status == 401

        cfg.write_text("tenants:\n  - {name: alpha, api_key: key-alpha}\n  - {name: beta, api_key: key-beta}\n")
        gp.proc.send_signal(signal.SIGHUP)
        await wait_until(lambda: "config reloaded" in gp.stderr_text, 10.0, what="the reload log line")
        r = await http_request(gp.port, "POST", "/v1/chat/completions", body, beta, timeout=15)
        assert r.status == 200, r.body
        # The sim engines chargeVelocity started are still the gateway's endpoints.
        assert r.headers["x-velocity-endpoint"] in ("sim-0", "sim-1")
        stats = json.loads((await http_request(gp.admin_port, "GET", "/stats", headers=beta)).body)
        assert sorted(e["name"] for e in stats["endpoints"]) == ["sim-0", "sim-1"]
        gp.proc.send_signal(signal.SIGTERM)
        assert gp.wait(20) == 0
