"""A gateway in front of the vllm tier's engines.

    async with vllm_gateway(pair.engines, tenants=[...]) as gw:   # kv_events=True: precise routing's feed

Health checks as fast as the sim tests' (a test sees an ejection within a second), with
a longer timeout: a vLLM CPU engine busy with a batch on a small shared machine answers
/health late, and a late answer is not an ejection.
"""

from __future__ import annotations

from tests.support.gateway import FAST_HEALTH, gateway_settings, running_gateway

HEALTH = {**FAST_HEALTH, "check_timeout_ms": 5000.0}


def vllm_gateway(engines, kv_events: bool = False, **keys):
    keys.setdefault("health", HEALTH)
    return running_gateway(
        settings=gateway_settings(endpoints=[e.endpoint(kv_events=kv_events) for e in engines], **keys)
    )
