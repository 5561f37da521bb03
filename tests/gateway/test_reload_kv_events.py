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


async def test_a_reload_of_free_cache_weight_keeps_the_token_side_and_takes_the_weight(tmp_path):
    tok = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tok))
    routing = {"prefix": "precise", "tokenizer": str(tok)}
    async with running_gateway(healthy=0, endpoints=[ep("e1", tmp_path)], routing=routing) as gw:
        before = gw.kv.precise
        assert before is not None and before.settings.free_cache_weight == 1.0
        gw.reload(gateway_settings(endpoints=[ep("e1", tmp_path)], routing={**routing, "free_cache_weight": 0.25}))
        # The same token side (its cache kept), reading the new weight.
        assert gw.kv.precise is before and before.settings.free_cache_weight == 0.25
        # A tokenizer change makes a new one.
        other = tmp_path / "other.json"
        Tokenizer(models.WordLevel({"[UNK]": 0, "b": 1}, unk_token="[UNK]")).save(str(other))
        gw.reload(gateway_settings(endpoints=[ep("e1", tmp_path)], routing={**routing, "tokenizer": str(other)}))
        assert gw.kv.precise is not before
