"""KV event subscribers follow the endpoints: started with the gateway or when a reload
adds an endpoint with `kv_events`, stopped when it leaves or the gateway stops."""
from __future__ import annotations

import pytest

from tests.support.gateway import gateway_settings, running_gateway
from velocity_fast.config import EndpointConfig, KVEventsConfig

pytestmark = pytest.mark.timeout(30)


def ep(name: str, sock_dir, kv: bool = True) -> EndpointConfig:
    events = KVEventsConfig(endpoint=f"ipc://{sock_dir}/{name}.kv", replay_endpoint=None, topic="kv") if kv else None
    return EndpointConfig(name=name, url="http://127.0.0.1:9", model="m", kv_events=events)


async def test_subscribers_start_stop_and_follow_reloads(tmp_path):
    async with running_gateway(healthy=0, endpoints=[ep("e1", tmp_path), ep("e2", tmp_path, kv=False)]) as gw:
        subs = gw.kv._subs
        assert sorted(subs) == ["e1"] and subs["e1"].alive
        first = subs["e1"]
        changes, _ = gw.reload(gateway_settings(endpoints=[ep("e2", tmp_path, kv=False), ep("e3", tmp_path)]))
        assert sorted(subs) == ["e3"] and subs["e3"].alive
        assert not first.alive and "e1" not in gw.kv.index.endpoints()
        third = subs["e3"]
    assert not third.alive and not gw.kv._subs
