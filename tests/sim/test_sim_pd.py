"""The sim engine's prefill and decode roles, as vLLM's NixlConnector plays them
(sim/pd.py): the params a prefill answers, the blocks it holds until pulled or expired,
a decode's pull, and what it does with params it cannot use."""

from __future__ import annotations

import json

from tests.support.gateway import wait_until
from tests.support.sim import http_request, sim_engine

PROMPT = [{"role": "user", "content": "tell me about the sea " * 40}]
ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _kv(eng) -> dict:
    return json.loads(eng.get("/kv_transfer/stats")[1])


async def _prefill(eng, rid="r1"):
    body = {"messages": PROMPT, "max_tokens": 1, "kv_transfer_params": ASK}
    return await http_request(eng.port, "POST", "/v1/chat/completions", body, {"x-request-id": rid})


async def test_a_prefill_answers_vllms_params_and_holds_its_blocks_until_pulled():
    with (
        sim_engine("--enable-prompt-tokens-details", time_scale=20) as p,
        sim_engine("--enable-prompt-tokens-details", time_scale=20) as d,
    ):
        r = await _prefill(p)
        assert r.status == 200
        out = r.json()
        params = out["kv_transfer_params"]
        assert set(params) == {
            "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
            "remote_host", "remote_port", "tp_size", "transfer_mode", "remote_num_tokens",
            "remote_blocks_expiry_time", "dcp_size", "pp_size",
        }  # fmt: skip
        assert (params["do_remote_prefill"], params["do_remote_decode"]) == (True, False)
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
        assert params["remote_request_id"] == "chatcmpl-r1"
        assert params["transfer_mode"] == "pull" and params["tp_size"] == 1
        prompt_tokens = out["usage"]["prompt_tokens"]
        assert params["remote_num_tokens"] == prompt_tokens
        blocks = -(-prompt_tokens // 16)
        assert len(params["remote_block_ids"]) == _kv(p)["held_blocks"] >= blocks
        assert p.metric("vllm:kv_cache_usage_perc") > 0  # held: still in use

        body = {"messages": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
        r = await http_request(d.port, "POST", "/v1/chat/completions", body)
        assert r.status == 200
        usage = r.json()["usage"]
        # Pulled, not recomputed: the decode engine counts the prompt as cached, but the last token.
        assert usage["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}
        pk, dk = _kv(p), _kv(d)
        assert (pk["pulled"], pk["held_blocks"], pk["held_requests"]) == (1, 0, 0)
        assert (dk["remote_prefills"], dk["pull_failures"]) == (1, 0)
        assert p.metric("vllm:kv_cache_usage_perc") == 0


async def test_blocks_nobody_pulls_are_freed_when_they_expire():
    # 480 s by default (vLLM's); 2 s here, at time scale 20: 0.1 s.
    with sim_engine("--kv-transfer-timeout", "2", time_scale=20) as p:
        assert (await _prefill(p)).status == 200
        assert _kv(p)["held_blocks"] > 0
        await wait_until(lambda: _kv(p)["held_blocks"] == 0, 5.0, what="the expiry")
        k = _kv(p)
        assert (k["expired"], k["pulled"]) == (1, 0) and k["expired_blocks"] > 0
        assert p.metric("vllm:kv_cache_usage_perc") == 0


async def test_a_pull_that_fails_recomputes_the_prompt():
    """The prefill engine is gone (or the blocks expired): vLLM's recompute policy."""
    with sim_engine("--enable-prompt-tokens-details", time_scale=20) as d:
        with sim_engine(time_scale=20) as p:
            params = (await _prefill(p)).json()["kv_transfer_params"]
        body = {"messages": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
        r = await http_request(d.port, "POST", "/v1/chat/completions", body)
        assert r.status == 200
        assert r.json()["usage"]["prompt_tokens_details"] is None  # computed here: nothing cached
        assert (_kv(d)["pull_failures"], _kv(d)["remote_prefills"]) == (1, 0)


async def test_params_that_are_not_an_object_are_refused_as_vllm_refuses_them():
    with sim_engine(time_scale=20) as e:
        for bad in ("pull", 3, [1]):
            body = {"messages": PROMPT, "max_tokens": 4, "kv_transfer_params": bad}
            r = await http_request(e.port, "POST", "/v1/chat/completions", body)
            assert r.status == 400
            err = r.json()["error"]
            assert err["type"] == "Bad Request" and err["param"] == "body.kv_transfer_params"
            assert err["code"] == 400


async def test_params_without_a_remote_field_are_served_as_a_plain_request():
    """vLLM logs "Got invalid KVTransferParams" and computes the prompt itself."""
    with sim_engine(time_scale=20) as p, sim_engine(time_scale=20) as d:
        params = (await _prefill(p)).json()["kv_transfer_params"]
        del params["remote_host"]
        body = {"messages": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
        r = await http_request(d.port, "POST", "/v1/chat/completions", body)
        assert r.status == 200
        assert (_kv(d)["remote_prefills"], _kv(d)["pull_failures"]) == (0, 0)
        assert _kv(p)["held_blocks"] > 0  # not pulled: left to the expiry


async def test_a_pull_naming_unknown_blocks_or_no_ids_is_refused():
    with sim_engine(time_scale=20) as p:
        params = (await _prefill(p)).json()["kv_transfer_params"]
        for body, status in (
            ({"remote_request_id": params["remote_request_id"], "remote_engine_id": "other"}, 404),
            ({"remote_request_id": "nope", "remote_engine_id": params["remote_engine_id"]}, 404),
            ({"remote_engine_id": params["remote_engine_id"]}, 400),
            (b"not json", 400),
        ):
            r = await http_request(p.port, "POST", "/kv_transfer/pull", body)
            assert r.status == status, (body, r.body)
        assert _kv(p)["held_blocks"] > 0
