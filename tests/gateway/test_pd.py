"""Prefill/decode disaggregation through the gateway, against real sim engines (docs/pd.md).

The sim engines play vLLM's NixlConnector: a prefill engine holds the prompt's blocks
until a decode engine pulls them (``GET /kv_transfer/stats`` counts them), so every test
ends by showing that no KV is stranded on a prefill engine.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.gateway import gateway_settings, running_gateway, wait_until
from tests.support.sim import http_request, open_request, sim_engine
from velocity_fast.config import EndpointConfig

LONG = "the quick brown fox jumps over the lazy dog " * 60  # ~660 tokens: past the decider's 256
SHORT = "hello there"  # a few tokens: the decode engine alone

# Health checks that do not notice a killed engine during a test: the request finds it.
SLOW_HEALTH = {"check_interval_ms": 60_000.0, "scrape_interval_ms": 60_000.0}


def _eps(**roles: tuple) -> list[EndpointConfig]:
    return [EndpointConfig(name=n, url=eng.url, model=eng.model, role=role) for n, (eng, role) in roles.items()]


def _kv(eng) -> dict:
    status, body = eng.get("/kv_transfer/stats")
    assert status == 200
    return json.loads(body)


async def _chat(gw, content: str, **extra) -> object:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
    return await http_request(gw.port, "POST", "/v1/chat/completions", body)


async def _stats(gw) -> dict:
    r = await http_request(gw.admin_port, "GET", "/stats")
    return r.json()


@pytest.fixture
def engines():
    flags = ("--enable-prompt-tokens-details",)
    with sim_engine(*flags, time_scale=20) as p1, sim_engine(*flags, time_scale=20) as d1:
        yield p1, d1


def test_long_prompt_takes_two_legs_and_frees_the_prefill_blocks(engines):
    p1, d1 = engines

    async def go():
        eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
        async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
            r = await _chat(gw, LONG)
            assert r.status == 200, r.body
            body = r.json()
            # The decode engine reported the pulled prompt as cached; the client sees the
            # prompt as the prefill engine computed it (nothing cached there).
            assert body["usage"]["prompt_tokens"] > 256
            assert body["usage"]["prompt_tokens_details"] is None
            assert body["usage"]["completion_tokens"] == 8
            assert body["choices"][0]["finish_reason"] == "length"
            # The same text a colocated engine writes for the prompt (the sim's reply is
            # drawn from the prompt alone).
            direct = await http_request(
                d1.port,
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8},
            )
            assert body["choices"][0]["message"] == direct.json()["choices"][0]["message"]
            st = await _stats(gw)
            assert st["pd"]["sim-model"]["disaggregated"] == 1
            assert st["pd"]["sim-model"]["colocated"] == 0
            assert {e["name"]: e["role"] for e in st["endpoints"]} == {"p1": "prefill", "d1": "decode"}
            metrics = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
            assert 'velocity_endpoint_role{endpoint="p1",model="sim-model",role="prefill"} 1' in metrics
            assert 'velocity_pd_requests_total{model="sim-model",way="disaggregated"} 1' in metrics

    asyncio.run(go())
    pk, dk = _kv(p1), _kv(d1)
    assert pk["prefills"] == 1 and pk["pulled"] == 1
    assert pk["held_blocks"] == 0  # nothing stranded
    assert dk["remote_prefills"] == 1 and dk["pull_failures"] == 0


def test_short_prompt_runs_on_the_decode_engine_alone(engines):
    p1, d1 = engines

    async def go():
        eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
        async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
            r = await _chat(gw, SHORT)
            assert r.status == 200, r.body
            assert r.headers["x-velocity-endpoint"] == "d1"
            st = await _stats(gw)
            assert st["pd"]["sim-model"] == {
                "min_uncached_tokens": 256,
                "max_prefill_tokens_in_flight": 16384,
                "disaggregated": 0,
                "colocated": 1,
                "prefill_retries": 0,
                "prefill_failed": 0,
                "prefill_busy": 0,
                "prefill_tokens_in_flight": {},
            }

    asyncio.run(go())
    assert _kv(p1)["prefills"] == 0
    assert _kv(d1)["remote_prefills"] == 0


def test_a_cached_prompt_on_the_decode_engine_skips_the_prefill_leg(engines):
    """The decider reads the chosen decode engine's prefix: a prompt it was sent already is
    mostly cached there, and runs there alone."""
    p1, d1 = engines

    async def go():
        eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
        async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
            assert (await _chat(gw, LONG)).status == 200
            assert (await _chat(gw, LONG)).status == 200
            st = await _stats(gw)
            assert (st["pd"]["sim-model"]["disaggregated"], st["pd"]["sim-model"]["colocated"]) == (1, 1)

    asyncio.run(go())
    assert _kv(p1)["prefills"] == 1


def test_a_stream_through_both_legs_equals_a_colocated_stream(engines):
    """The decode leg streams to the client as any answer does; its text, its end and its
    usage (merged: the prompt as the prefill engine saw it) are a colocated stream's."""
    p1, d1 = engines
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def read(port, path="/v1/chat/completions"):
        st = await open_request(port, "POST", path, body)
        try:
            assert st.status == 200
            return [json.loads(e) if e != "[DONE]" else e for e in [e async for e in st.events()]]
        finally:
            await st.close()

    def strip(events):
        out = []
        for e in events:
            if isinstance(e, dict):
                e = {k: v for k, v in e.items() if k not in ("id", "created")}
            out.append(e)
        return out

    with sim_engine("--enable-prompt-tokens-details", time_scale=20) as solo:

        async def go():
            eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
            async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
                through = await read(gw.port)
                st = await _stats(gw)
                assert st["pd"]["sim-model"]["disaggregated"] == 1
            colocated = await read(solo.port)
            assert strip(through) == strip(colocated)
            assert through[-1] == "[DONE]"
            assert "prompt_tokens_details" not in through[-2]["usage"]  # d1 reported the pulled prompt cached

        asyncio.run(go())
    assert _kv(d1)["remote_prefills"] == 1
    assert _kv(p1)["held_blocks"] == 0


def test_both_legs_carry_the_request_id_and_the_params_pass_byte_exact():
    """As the engines see the two legs: the prefill leg is the client's request asking for
    a remote decode of one token, whole; the decode leg is the client's request with the
    prefill answer's ``kv_transfer_params`` as they came (spacing and unknown fields too);
    both carry the client's X-Request-Id."""
    params = (
        b'{"do_remote_prefill": true, "do_remote_decode":false, "remote_block_ids":[3, 4],'
        b' "remote_engine_id":"eng-1","remote_request_id":"r","remote_host":"10.0.0.9",'
        b'"remote_port":5600,"tp_size":1,"transfer_mode":"pull","some_new_field":1.50}'
    )
    prefill_reply = (
        b'{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":700,'
        b'"total_tokens":701,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":64}},'
        b'"kv_transfer_params":' + params + b"}"
    )
    decode_reply = (
        b'{"id":"y","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"hi"},"logprobs":{"content":[{"token":"hi","logprob":-0.5}]},'
        b'"finish_reason":"length"}],"usage":{"prompt_tokens":700,"total_tokens":702,'
        b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":699}}}'
    )

    async def go():
        from tests.support.gateway import RecordingUpstream

        async with RecordingUpstream(prefill_reply) as pre, RecordingUpstream(decode_reply) as dec:
            eps = [
                EndpointConfig(name="p", url=pre.url, model="m", role="prefill"),
                EndpointConfig(name="d", url=dec.url, model="m", role="decode"),
            ]
            async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
                client = {
                    "model": "m",
                    "messages": [{"role": "user", "content": LONG}],
                    "max_tokens": 8,
                    "max_completion_tokens": 8,
                    "logprobs": True,
                }
                r = await http_request(
                    gw.port, "POST", "/v1/chat/completions", client, headers={"x-request-id": "req-42"}
                )
                assert r.status == 200, r.body
                assert r.headers["x-request-id"] == "req-42"
                out = r.json()
                # usage merged: prompt and cached as the prefill engine saw them, completion
                # from decode; logprobs from decode.
                assert out["usage"] == {
                    "prompt_tokens": 700,
                    "total_tokens": 702,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 64},
                }
                assert out["choices"][0]["logprobs"] == {"content": [{"token": "hi", "logprob": -0.5}]}
            ((_, ppath, pheads, pbody),) = [q for q in pre.requests if q[0] == "POST"]
            ((_, dpath, dheads, dbody),) = [q for q in dec.requests if q[0] == "POST"]
            assert ppath == dpath == "/v1/chat/completions"
            assert pheads["x-request-id"] == dheads["x-request-id"] == "req-42"
            leg = json.loads(pbody)
            assert leg["kv_transfer_params"] == {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            assert (leg["max_tokens"], leg["max_completion_tokens"], leg["stream"]) == (1, 1, False)
            assert "stream_options" not in leg
            assert leg["messages"] == client["messages"] and leg["logprobs"] is True
            # The decode leg: the params byte for byte, the rest the client's request.
            assert b'"kv_transfer_params":' + params in dbody
            decoded = json.loads(dbody)
            assert decoded.pop("kv_transfer_params") == json.loads(params)
            assert decoded == client

    asyncio.run(go())


def test_prefill_engine_killed_is_retried_once_on_another(engines):
    p1, d1 = engines
    with sim_engine(time_scale=20) as p2:

        async def go():
            # p2 first: an equal pick (no load, no prefix anywhere) takes it.
            eps = _eps(p2=(p2, "prefill"), p1=(p1, "prefill"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, health=SLOW_HEALTH)
            async with running_gateway(settings=settings) as gw:
                p2.proc.kill()  # the engine dies; the gateway's checks have not seen it yet
                statuses = []
                for i in range(12):
                    r = await _chat(gw, f"{i} {LONG}")
                    statuses.append(r.status)
                    st = await _stats(gw)
                    if st["pd"]["sim-model"]["prefill_retries"]:
                        break
                assert statuses == [200] * len(statuses)  # none lost
                assert st["pd"]["sim-model"]["prefill_retries"] == 1
                assert st["pd"]["sim-model"]["prefill_failed"] == 0
                return len(statuses)

        n = asyncio.run(go())
    pk = _kv(p1)
    assert pk["prefills"] == n and pk["pulled"] == n and pk["held_blocks"] == 0


def test_every_prefill_engine_failing_is_a_503_and_no_decode_leg(engines):
    p1, d1 = engines
    with sim_engine(time_scale=20) as p2:

        async def go():
            eps = _eps(p1=(p1, "prefill"), p2=(p2, "prefill"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, health=SLOW_HEALTH)
            async with running_gateway(settings=settings) as gw:
                p1.proc.kill()
                p2.proc.kill()
                r = await _chat(gw, LONG)
                assert r.status == 503
                err = r.json()["error"]
                assert "prefill" in err["message"]
                assert err["code"] == 503 and err["type"]
                st = await _stats(gw)
                assert st["pd"]["sim-model"]["prefill_failed"] == 1
                assert st["pd"]["sim-model"]["prefill_retries"] == 1

        asyncio.run(go())
    # No decode leg was sent: the decode engine saw no request at all.
    assert d1.metric("vllm:prompt_tokens_total") == 0
    assert _kv(d1)["remote_prefills"] == 0


def test_prefill_leg_that_hangs_times_out_and_is_retried(engines):
    """A prefill engine that stops answering (its process stopped) is given
    ``pd.prefill_timeout_s``, then the other prefill engine serves the request."""
    import os
    import signal

    p1, d1 = engines
    with sim_engine(time_scale=20) as p2:

        async def go():
            eps = _eps(p2=(p2, "prefill"), p1=(p1, "prefill"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, health=SLOW_HEALTH, pd={"prefill_timeout_s": 0.5})
            async with running_gateway(settings=settings) as gw:
                os.kill(p2.proc.pid, signal.SIGSTOP)
                try:
                    for i in range(12):
                        r = await _chat(gw, f"{i} {LONG}")
                        assert r.status == 200, r.body
                        st = await _stats(gw)
                        if st["pd"]["sim-model"]["prefill_retries"]:
                            break
                    assert st["pd"]["sim-model"]["prefill_retries"] == 1
                finally:
                    os.kill(p2.proc.pid, signal.SIGCONT)

        asyncio.run(go())
    assert _kv(p1)["held_blocks"] == 0


def test_client_leaving_during_the_prefill_leg_aborts_it(engines):
    """The prefill engine is slow here (its prompt takes seconds): the client leaves while
    it computes; the prefill request is aborted (its blocks freed, nothing held), no
    decode leg is sent, and the lease ends."""
    _, d1 = engines
    with sim_engine("--prefill-tps", "200", time_scale=1) as slow:

        async def go():
            eps = _eps(p1=(slow, "prefill"), d1=(d1, "decode"))
            async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
                body = json.dumps(
                    {"model": "sim-model", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
                ).encode()
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await wait_until(lambda: slow.metric("vllm:num_requests_running") == 1, 5.0, what="the prefill")
                assert gw.endpoints["d1"].inflight == 1  # the lease holds the decode engine meanwhile
                writer.transport.abort()  # the client leaves
                await wait_until(lambda: slow.metric("vllm:num_requests_running") == 0, 5.0, what="the abort")
                await wait_until(lambda: gw.endpoints["d1"].inflight == 0, 5.0, what="the lease's end")

        asyncio.run(go())
        sk = _kv(slow)
        assert sk["prefills"] == 0 and sk["held_blocks"] == 0
        assert slow.metric("vllm:kv_cache_usage_perc") == 0
    assert d1.metric("vllm:prompt_tokens_total") == 0


def test_a_reload_that_changes_roles_is_applied_and_one_that_breaks_them_refused(engines, caplog):
    import logging

    from velocity_fast.config import ConfigError
    from velocity_fast.gateway.reload import Reloader

    p1, d1 = engines

    async def go():
        colocated = _eps(p1=(p1, "both"), d1=(d1, "both"))
        async with running_gateway(settings=gateway_settings(endpoints=colocated)) as gw:
            assert gw.pools["sim-model"].pd is None  # no roles: the common path
            split = gateway_settings(
                endpoints=_eps(p1=(p1, "prefill"), d1=(d1, "decode")), pd={"min_uncached_tokens": 64}
            )
            reloader = Reloader(gw, lambda: split)
            assert await reloader.reload()
            await wait_until(lambda: all(e.healthy for e in gw.endpoints.values()), 5.0, what="re-added endpoints")
            assert (await _chat(gw, LONG)).status == 200
            st = await _stats(gw)
            assert st["pd"]["sim-model"]["disaggregated"] == 1
            assert st["pd"]["sim-model"]["min_uncached_tokens"] == 64
            assert {e["name"]: e["role"] for e in st["endpoints"]} == {"p1": "prefill", "d1": "decode"}
            reloader.close()

            def broken():
                return gateway_settings(endpoints=_eps(p1=(p1, "prefill"), d1=(d1, "prefill")))

            reloader = Reloader(gw, broken)
            with caplog.at_level(logging.ERROR, logger="velocity.reload"):
                assert not await reloader.reload()
            lines = [r.getMessage() for r in caplog.records if r.name == "velocity.reload"]
            assert any("none that decodes" in line for line in lines)
            assert {e.name: e.role for e in gw.endpoints.values()} == {"p1": "prefill", "d1": "decode"}
            reloader.close()

            reloader = Reloader(gw, lambda: gateway_settings(endpoints=colocated))
            assert await reloader.reload()
            assert gw.pools["sim-model"].pd is None
            reloader.close()

    with pytest.raises(ConfigError):
        gateway_settings(endpoints=_eps(p1=(p1, "prefill"), d1=(d1, "prefill")))
    asyncio.run(go())
    assert _kv(p1)["held_blocks"] == 0


def test_a_prefill_engine_refusing_the_request_answers_the_client_and_sends_no_decode():
    """A 400 from the prefill engine is about the request, not the engine: it is the
    client's answer, as vLLM wrote it, and it is not retried nor sent to decode."""

    async def go():
        from tests.support.gateway import RecordingUpstream

        async with (
            RecordingUpstream(reject_fields=("kv_transfer_params",)) as pre,
            RecordingUpstream(reject_fields=("kv_transfer_params",)) as pre2,
            RecordingUpstream() as dec,
        ):
            eps = [
                EndpointConfig(name="p", url=pre.url, model="m", role="prefill"),
                EndpointConfig(name="p2", url=pre2.url, model="m", role="prefill"),
                EndpointConfig(name="d", url=dec.url, model="m", role="decode"),
            ]
            async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
                client = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
                r = await http_request(gw.port, "POST", "/v1/chat/completions", client)
                assert r.status == 400
                assert r.json()["error"]["param"] == "kv_transfer_params"
                st = await _stats(gw)
                assert st["pd"]["m"]["prefill_retries"] == 0
            posts = [q for q in pre.requests + pre2.requests if q[0] == "POST"]
            assert len(posts) == 1
            assert not [q for q in dec.requests if q[0] == "POST"]

    asyncio.run(go())


def test_completions_and_generate_take_the_two_legs_too(engines):
    p1, d1 = engines

    async def go():
        eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
        async with running_gateway(settings=gateway_settings(endpoints=eps)) as gw:
            r = await http_request(
                gw.port, "POST", "/v1/completions", {"model": "sim-model", "prompt": "a " + LONG, "max_tokens": 4}
            )
            assert r.status == 200, r.body
            assert r.json()["usage"]["completion_tokens"] == 4
            r = await http_request(gw.port, "POST", "/generate", {"prompt": "b " + LONG, "max_tokens": 4})
            assert r.status == 200, r.body
            st = await _stats(gw)
            assert st["pd"]["sim-model"]["disaggregated"] == 2

    asyncio.run(go())
    pk = _kv(p1)
    assert pk["prefills"] == 2 and pk["pulled"] == 2 and pk["held_blocks"] == 0


def test_a_dead_decode_engine_is_retried_on_another_with_the_same_params(engines):
    """The decode leg fails before its first byte (its engine is gone): it goes once more
    to another decode engine with the prefill answer's params, which pulls the blocks."""
    p1, d1 = engines
    with sim_engine(time_scale=20) as d2:

        async def go():
            eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"), d2=(d2, "decode"))
            settings = gateway_settings(endpoints=eps, health=SLOW_HEALTH)
            async with running_gateway(settings=settings) as gw:
                d2.proc.kill()
                retried = 0.0
                n = 0
                while not retried and n < 12:
                    r = await _chat(gw, f"{n} {LONG}")
                    n += 1
                    assert r.status == 200, r.body
                    assert r.headers["x-velocity-endpoint"] == "d1"
                    metrics = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
                    retried = sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in metrics.splitlines()
                        if line.startswith('velocity_upstream_errors_total{endpoint="d2"')
                    )
                assert retried == 1
                st = await _stats(gw)
                assert st["pd"]["sim-model"]["disaggregated"] == n
                assert st["pd"]["sim-model"]["prefill_retries"] == 0
                return n

        n = asyncio.run(go())
    pk, dk = _kv(p1), _kv(d1)
    assert pk["prefills"] == pk["pulled"] == n and pk["held_blocks"] == 0
    assert dk["remote_prefills"] == n


def test_no_request_is_lost_when_a_prefill_engine_is_killed_under_load(engines):
    """Eight requests at once, their prefill legs in flight on two slow prefill engines;
    one engine is killed: every request is answered 200, and the other prefill engine
    holds nothing after."""
    _, d1 = engines
    slow = ("--prefill-tps", "2000")
    with sim_engine(*slow, time_scale=2) as pa, sim_engine(*slow, time_scale=2) as pb:

        async def go():
            eps = _eps(pa=(pa, "prefill"), pb=(pb, "prefill"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, health=SLOW_HEALTH)
            async with running_gateway(settings=settings) as gw:
                tasks = [asyncio.ensure_future(_chat(gw, f"{i} {LONG}")) for i in range(8)]
                await wait_until(
                    lambda: (
                        pa.metric("vllm:num_requests_running") + pa.metric("vllm:num_requests_waiting") > 0
                        and pb.metric("vllm:num_requests_running") + pb.metric("vllm:num_requests_waiting") > 0
                    ),
                    10.0,
                    what="prefill legs on both engines",
                )
                pb.proc.kill()
                rs = await asyncio.gather(*tasks)
                assert [r.status for r in rs] == [200] * 8, [r.body for r in rs if r.status != 200]
                st = await _stats(gw)
                assert st["pd"]["sim-model"]["prefill_retries"] >= 1
                assert st["pd"]["sim-model"]["prefill_failed"] == 0

        asyncio.run(go())
        assert _kv(pa)["held_blocks"] == 0
    assert _kv(d1)["remote_prefills"] == 8


def test_a_decode_engine_dying_mid_stream_after_the_pull_ends_that_stream_only(engines):
    """What vLLM 0.32 on CPU did: the decode engine pulled the blocks, then died. The
    client's stream ends with vLLM's error event and [DONE]; the gateway goes on serving
    through the other decode engine; the prefill engine holds nothing."""
    p1, d1 = engines
    with sim_engine("--decode-tps", "20", time_scale=1) as dying:

        async def go():
            eps = _eps(p1=(p1, "prefill"), dying=(dying, "decode"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, health=SLOW_HEALTH)
            async with running_gateway(settings=settings) as gw:
                gw.endpoints["d1"].healthy = False  # the first request goes to the engine that dies
                body = {
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": LONG}],
                    "max_tokens": 200,
                    "stream": True,
                }
                st = await open_request(gw.port, "POST", "/v1/chat/completions", body)
                try:
                    assert st.status == 200
                    events = []
                    async for e in st.events():
                        events.append(e)
                        if len(events) == 3:
                            dying.proc.kill()
                finally:
                    await st.close()
                assert events[-1] == "[DONE]"
                assert "error" in json.loads(events[-2])
                gw.endpoints["d1"].healthy = True
                r = await _chat(gw, "again " + LONG)
                assert r.status == 200, r.body
                assert r.headers["x-velocity-endpoint"] == "d1"

        asyncio.run(go())
    pk = _kv(p1)
    assert pk["prefills"] == pk["pulled"] == 2 and pk["held_blocks"] == 0


def test_the_tenants_books_settle_from_the_merged_usage(engines):
    """A stream whose client asked no usage: the gateway asks the decode engine for it,
    cuts it from the client's stream, and settles the tenant with the prompt as the
    prefill engine computed it (nothing cached), not as the decode engine counted it (all
    of it cached, pulled)."""
    p1, d1 = engines

    async def go():
        eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
        settings = gateway_settings(endpoints=eps, tenants=[{"name": "t", "api_key": "k"}])
        async with running_gateway(settings=settings) as gw:
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 8,
                "stream": True,
            }
            st = await open_request(gw.port, "POST", "/v1/chat/completions", body, {"authorization": "Bearer k"})
            try:
                assert st.status == 200
                events = [e async for e in st.events()]
            finally:
                await st.close()
            assert events[-1] == "[DONE]"
            assert not any('"usage"' in e and '"choices":[]' in e for e in events)  # not asked: cut
            tokens = gw.tenant_stats()["t"]["tokens"]
            assert tokens["prompt"] > 256 and tokens["completion"] == 8
            assert tokens["cached"] == 0

    asyncio.run(go())
    assert _kv(d1)["remote_prefills"] == 1


def test_prefill_legs_spread_by_the_tokens_in_flight(engines):
    """Four long prompts at once, two prefill engines: the engines' gauges come a scrape
    late, so the prefill pick counts the legs it has in flight on each (their uncached
    tokens): two legs each."""
    p1, d1 = engines
    with sim_engine("--prefill-tps", "2000", time_scale=4) as p2:

        async def go():
            eps = _eps(p1=(p1, "prefill"), p2=(p2, "prefill"), d1=(d1, "decode"))
            async with running_gateway(settings=gateway_settings(endpoints=eps, health=SLOW_HEALTH)) as gw:
                rs = await asyncio.gather(*(_chat(gw, f"{i} {LONG}") for i in range(4)))
                assert [r.status for r in rs] == [200] * 4
                assert (await _stats(gw))["pd"]["sim-model"]["prefill_tokens_in_flight"] == {}

        asyncio.run(go())
        assert (_kv(p1)["prefills"], _kv(p2)["prefills"]) == (2, 2)


def test_a_burst_past_the_decode_engines_limits_waits_for_them_instead_of_failing():
    """Admission's leases are decode slots: a prefill-only engine's limit is no room for
    one. Sixteen long prompts at once on one prefill and one decode engine whose limits
    start at 2: the requests past the decode engine's room wait in admission's queue and
    are all served (before, the prefill engine's slots were counted as room, and each
    lease granted past the decode engine's failed 503 "no healthy decode engine", which
    freed it for the next to fail the same way)."""
    with sim_engine(time_scale=1) as p1, sim_engine(time_scale=1) as d1:

        async def go():
            eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, admission={"aimd_initial": 2})
            async with running_gateway(settings=settings) as gw:
                rs = await asyncio.gather(
                    *(
                        http_request(
                            gw.port,
                            "POST",
                            "/v1/chat/completions",
                            {
                                "model": "sim-model",
                                "messages": [{"role": "user", "content": f"{i} {LONG}"}],
                                "max_tokens": 40,
                            },
                            timeout=60,
                        )
                        for i in range(16)
                    )
                )
                assert [r.status for r in rs] == [200] * 16, [r.body[:200] for r in rs if r.status != 200][:2]
                st = await _stats(gw)
                assert st["pd"]["sim-model"]["disaggregated"] == 16
                assert st["admission"]["counters"]["completed"] == 16

        asyncio.run(go())
        assert _kv(p1)["held_blocks"] == 0


def test_prefill_engines_at_their_bound_run_the_next_prompts_on_the_decode_engine():
    """Conditional disaggregation: a slow prefill engine with one long leg in flight and
    ``pd.max_prefill_tokens_in_flight`` below two legs' tokens. The prompts that arrive
    meanwhile run on the decode engine alone (``prefill_busy``) instead of queueing
    behind it; all are served, the first by two legs."""
    with sim_engine("--prefill-tps", "300", time_scale=1) as p1, sim_engine(time_scale=20) as d1:

        async def go():
            eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
            settings = gateway_settings(endpoints=eps, pd={"max_prefill_tokens_in_flight": 1000})
            async with running_gateway(settings=settings) as gw:
                first = asyncio.create_task(_chat(gw, f"first {LONG}"))
                await wait_until(lambda: gw.pools["sim-model"].pd.pending, 5.0, what="the first leg in flight")
                rest = await asyncio.gather(*(_chat(gw, f"{i} {LONG}") for i in range(3)))
                assert [r.status for r in rest] == [200] * 3, [r.body[:200] for r in rest]
                assert (await first).status == 200
                st = (await _stats(gw))["pd"]["sim-model"]
                assert (st["disaggregated"], st["prefill_busy"], st["colocated"]) == (1, 3, 0), st
                assert st["max_prefill_tokens_in_flight"] == 1000
                metrics = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
                assert 'velocity_pd_requests_total{model="sim-model",way="prefill_busy"} 3' in metrics
            # Without the bound, the same three wait for the prefill engine: two legs each.
            settings = gateway_settings(endpoints=eps, pd={"max_prefill_tokens_in_flight": 0})
            async with running_gateway(settings=settings) as gw:
                rs = await asyncio.gather(*(_chat(gw, f"again {i} {LONG}") for i in range(3)))
                assert [r.status for r in rs] == [200] * 3
                st = (await _stats(gw))["pd"]["sim-model"]
                assert (st["disaggregated"], st["prefill_busy"]) == (3, 0), st

        asyncio.run(go())
        assert _kv(p1)["held_blocks"] == 0


def test_roles_under_two_workers_serve_every_request_and_merge_their_counts(tmp_path):
    """``serve --workers 2`` with a prefill and a decode endpoint: a burst of long prompts
    spread over the workers by the kernel is served whole (each worker runs its own two
    legs under its own leases, the decode engine's limit shared between them), and
    /stats merges the workers' P/D counts; nothing is left held on the prefill engine."""
    from velocity_fast.harness.gateway import GatewayProcess

    with sim_engine(time_scale=4) as p1, sim_engine(time_scale=4) as d1:
        cfg = tmp_path / "pd.yaml"
        cfg.write_text(
            "workers: 2\n"
            "endpoints:\n"
            f"  - {{name: p1, url: '{p1.url}', model: sim-model, role: prefill}}\n"
            f"  - {{name: d1, url: '{d1.url}', model: sim-model, role: decode}}\n"
        )
        gp = GatewayProcess("serve", "--config", str(cfg))
        try:
            gp.start()

            async def go():
                await gp.wait_ready()
                rs = await asyncio.gather(
                    *(
                        http_request(
                            gp.port,
                            "POST",
                            "/v1/chat/completions",
                            {
                                "model": "sim-model",
                                "messages": [{"role": "user", "content": f"{i} {LONG}"}],
                                "max_tokens": 8,
                            },
                            timeout=60,
                        )
                        for i in range(24)
                    )
                )
                assert [r.status for r in rs] == [200] * 24, [r.body[:200] for r in rs if r.status != 200][:2]
                st = (await http_request(gp.admin_port, "GET", "/stats")).json()
                pd = st["pd"]["sim-model"]
                # (24 legs of about 660 tokens stay under the bound even in one worker.)
                assert (pd["disaggregated"], pd["prefill_busy"], pd["prefill_failed"]) == (24, 0, 0), pd
                assert pd["min_uncached_tokens"] == 256  # a setting: whole, not summed over workers

            asyncio.run(go())
        finally:
            gp.close()
        assert _kv(p1)["held_blocks"] == 0
        assert _kv(p1)["pulled"] == _kv(p1)["prefills"]


def test_a_slow_prefill_leg_is_not_counted_against_the_decode_engine():
    """Prefill owns the time to first token up to the decode leg: prefill legs of about
    2.2 s (past ``admission.ttft_slo_ms``, 2 s) on a slow prefill engine must not cut the
    decode engine's limit for a slow first token, nor teach its estimates a first token
    of seconds (before, each such request cut its limit by a quarter)."""
    with sim_engine("--prefill-tps", "300", time_scale=1) as p1, sim_engine(time_scale=20) as d1:

        async def go():
            eps = _eps(p1=(p1, "prefill"), d1=(d1, "decode"))
            async with running_gateway(settings=gateway_settings(endpoints=eps, health=SLOW_HEALTH)) as gw:
                before = (await _stats(gw))["admission"]["endpoints"]["d1"]["limit"]
                for i in range(3):
                    r = await _chat(gw, f"{i} {LONG}", stream=i == 2)
                    assert r.status == 200, r.body
                d = (await _stats(gw))["admission"]["endpoints"]["d1"]
                assert d["limit"] >= before, (before, d)
                assert d["estimates"]["service_ms"] < 1000.0, d
                assert d["estimates"]["ttft_ms"] < 1000.0, d  # the streamed one's first token
                assert (await _stats(gw))["pd"]["sim-model"]["disaggregated"] == 3

        asyncio.run(go())
