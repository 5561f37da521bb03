"""Traces through the gateway into vLLM: vLLM's own span of a request is a child of the
gateway's client span for it, as an operator following one trace sees it.

A vLLM CPU engine of its own, started with ``--otlp-traces-endpoint`` (OTLP/HTTP, vLLM's
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``) at a real receiver in the test
(tests/support/otlp.py), and a gateway tracing every request to the same receiver. The
tier's engine pair is stopped first (one pair of engines at a time on this machine)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.otlp import CLIENT, SERVER, Receiver, need_otel

need_otel()

from tests.support.sim import http_request  # noqa: E402
from tests.vllm.conftest import PAIRS  # noqa: E402
from tests.vllm.support.engines import START_TIMEOUT_S, VllmEngine  # noqa: E402
from tests.vllm.support.gateway import vllm_gateway  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


async def test_vllms_span_is_a_child_of_the_gateways_client_span(vllm_pairs):
    vllm_pairs.close()
    served = PAIRS["chatml"][0]
    with Receiver() as rx:
        eng = VllmEngine(
            vllm_pairs.py,
            vllm_pairs.models["chatml"],
            "traced",
            served,
            vllm_pairs.log_dir,
            extra_args=("--otlp-traces-endpoint", rx.url + "/v1/traces"),
            extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
        )
        eng.spawn()
        try:
            await asyncio.to_thread(eng.wait_ready, time.monotonic() + START_TIMEOUT_S)
            await asyncio.to_thread(eng.warm_up)
            async with vllm_gateway([eng], tracing={"sample_ratio": 1.0, "otlp_endpoint": rx.url}) as gw:
                body = {"model": served, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4}
                r = await http_request(gw.port, "POST", "/v1/chat/completions", body, timeout=60)
                assert r.status == 200, r.body
                trace_id = r.headers["traceparent"].split("-")[1]

                def both() -> bool:
                    names = {s["name"] for s in rx.spans if s["trace_id"] == trace_id}
                    return "llm_request" in names and any(
                        s["kind"] == CLIENT for s in rx.spans if s["trace_id"] == trace_id
                    )

                deadline = time.monotonic() + 30
                while not both() and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            spans = [s for s in rx.spans if s["trace_id"] == trace_id]
            assert both(), f"spans of the trace: {[(s['name'], s['kind']) for s in spans]}"
            (ours,) = [s for s in spans if s["kind"] == CLIENT]
            (theirs,) = [s for s in spans if s["name"] == "llm_request"]
            (server,) = [s for s in spans if s["kind"] == SERVER and s["name"].startswith("chat ")]
            print(
                f"\ntrace {trace_id}: {server['name']} -> client span {ours['span_id']} "
                f"-> vLLM's {theirs['name']} (parent {theirs['parent']}, service "
                f"{theirs['resource'].get('service.name')})"
            )
            assert theirs["parent"] == ours["span_id"], (theirs, ours)
            assert ours["parent"] == server["span_id"]
            assert theirs["start"] >= ours["start"] and theirs["resource"] != ours["resource"]
        finally:
            eng.stop()
