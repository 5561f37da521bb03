"""The context length the gateway reports is the one its engines accept, and a completion
longer than that is refused by the gateway with vLLM's 400, before admission charges it.

`/v1/models` gives, per model, the smallest `max_model_len` the pool's healthy engines
report in their own `/v1/models`, at most the gateway's `max_model_len` (the setting).
"""

from __future__ import annotations

import orjson

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import http_request, sim_engine


async def _models(gw) -> dict[str, int]:
    r = await http_request(gw.port, "GET", "/v1/models")
    assert r.status == 200, r.body
    return {m["id"]: m["max_model_len"] for m in orjson.loads(r.body)["data"]}


def _chat(max_tokens: int, key: str = "max_tokens") -> bytes:
    return orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], key: max_tokens})


async def test_models_reports_what_the_engines_accept_and_the_gateway_refuses_more():
    with (
        sim_engine(model="m1", time_scale=50) as small,
        sim_engine("--max-model-len", "8192", model="m1", time_scale=50) as large,
    ):
        async with running_gateway(small, large) as gw:  # max_model_len: the default, 131072
            await wait_until(
                lambda: all(e.max_model_len for e in gw.endpoints.values()), 5.0, what="the engines' context lengths"
            )
            assert await _models(gw) == {"m1": 4096}  # the sim engine's default, the smaller
            hdrs = {"content-type": "application/json"}
            for key in ("max_tokens", "max_completion_tokens"):
                r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(100_000_000, key), headers=hdrs)
                assert r.status == 400, (r.status, r.body)
                err = orjson.loads(r.body)["error"]
                assert err["param"] == key and "maximum context length is 4096 tokens" in err["message"], err
            r = await http_request(
                gw.port, "POST", "/generate", orjson.dumps({"prompt": "hi", "max_tokens": 4096}), headers=hdrs
            )
            assert r.status == 400 and b"4096" in r.body, (r.status, r.body)
            r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat(8), headers=hdrs)
            assert r.status == 200, r.body
            stats = orjson.loads((await http_request(gw.port, "GET", "/stats")).body)
            assert stats["admission"]["counters"]["admitted"] == 1  # the refused ones never reached it


async def test_the_gateways_own_max_model_len_caps_what_it_reports():
    with sim_engine(model="m1", time_scale=50) as eng:
        async with running_gateway(eng, max_model_len=1000) as gw:
            await wait_until(
                lambda: all(e.max_model_len for e in gw.endpoints.values()), 5.0, what="the engine's context length"
            )
            assert await _models(gw) == {"m1": 1000}
            r = await http_request(
                gw.port,
                "POST",
                "/v1/completions",
                orjson.dumps({"model": "m1", "prompt": "hi", "max_tokens": 1000}),
                headers={"content-type": "application/json"},
            )
            assert r.status == 400 and b"maximum context length is 1000 tokens" in r.body, r.body
