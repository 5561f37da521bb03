"""Helpers of the knob tests: an engine whose gauges a test sets, and metric reads.

async with GaugeEngine(waiting=3, kv=0.5) as eng:     # eng.url; eng.waiting = 0 later
    async with running_gateway(("a", eng.url, "m1"), policy="static") as gw:
        await admin_metric(gw.admin_port, "velocity_endpoint_engine_waiting", endpoint="a")
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import ScriptedServer
from tests.support.sim import http_request

__all__ = ["GaugeEngine", "admin_metrics", "admin_metric", "completion"]

REPLY = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "m1",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class GaugeEngine(ScriptedServer):
    """An engine whose /metrics report the ``running``, ``waiting`` and ``kv`` set on it.

    Completions answer at once, or wait while ``hold`` is set until ``release()``
    (``holding`` counts those waiting); with ``reset`` set, a completion's connection is
    aborted once its request is read (an engine that dies mid-request). ``served`` counts
    the completions answered.
    """

    def __init__(self, running: float = 0, waiting: float = 0, kv: float = 0.0) -> None:
        super().__init__()
        self.running, self.waiting, self.kv = running, waiting, kv
        self.hold = False
        self.reset = False
        self.served = 0
        self.holding = 0
        self.scrapes = 0
        self._release: asyncio.Event | None = None

    async def __aenter__(self):
        self._release = asyncio.Event()
        return await super().__aenter__()

    def release(self) -> None:
        """Let every held completion answer (and the ones held later, until hold is set again)."""
        self.hold = False
        self._release.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            method, path, headers, body = await self.read_request(reader)
            if path == "/health":
                out, ct = b"", "text/plain"
            elif path == "/v1/models":  # the gateway's monitor asks once (the context length)
                out, ct = b'{"object": "list", "data": []}', "application/json"
            elif path == "/metrics":
                self.scrapes += 1
                out = (
                    f"vllm:num_requests_running {self.running}\n"
                    f"vllm:num_requests_waiting {self.waiting}\n"
                    f"vllm:kv_cache_usage_perc {self.kv}\n"
                ).encode()
                ct = "text/plain"
            else:
                if self.reset:
                    writer.transport.abort()
                    return
                if self.hold:
                    self._release.clear()
                    self.holding += 1
                    try:
                        await self._release.wait()
                    finally:
                        self.holding -= 1
                self.served += 1
                out, ct = REPLY, "application/json"
            writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: {ct}\r\ncontent-length: {len(out)}\r\n\r\n".encode() + out)
            await writer.drain()


async def admin_metrics(admin_port: int) -> dict:
    """The admin port's /metrics as {(sample name, frozenset of label items): value}."""
    r = await http_request(admin_port, "GET", "/metrics")
    assert r.status == 200
    out = {}
    for fam in text_string_to_metric_families(r.body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


async def admin_metric(admin_port: int, name: str, **labels: str) -> float | None:
    """One sample of the admin port's /metrics (None when absent); ``labels`` must all match
    and, when several samples match, their values are summed."""
    found = [v for (n, lab), v in (await admin_metrics(admin_port)).items() if n == name and set(labels.items()) <= lab]
    return sum(found) if found else None


async def completion(port: int, headers: dict | None = None, timeout: float = 15.0, **body):
    """POST /v1/completions with a small body (model m1) and ``headers``."""
    payload = {"model": "m1", "prompt": "hello", "max_tokens": 2}
    payload.update(body)
    return await http_request(port, "POST", "/v1/completions", payload, headers or {}, timeout=timeout)
