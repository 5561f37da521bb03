"""The gateway's HTTP contract on real sockets (docs/design.md, "Arrival"): the status table, the
reason headers, what is forwarded to the engine, the identity headers, the native route,
and the admin port."""

from __future__ import annotations

import asyncio
import gc
import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import RecordingUpstream, running_gateway, wait_until
from tests.support.sim import free_port, http_request, start_sim_engine
from velocity_fast.gateway.exchange import Exchange

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def engine():
    eng = start_sim_engine(model=MODEL, time_scale=50)
    yield eng
    eng.stop()


def error_of(r) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == r.status
    return err


async def raw_exchange(port: int, data: bytes, *, pause: float = 0.0, rest: bytes = b"", timeout: float = 5.0) -> bytes:
    """Write ``data`` (then ``rest`` after ``pause``) and read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if pause:
            await asyncio.sleep(pause)
        if rest:
            writer.write(rest)
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.transport.abort()


# -- 400 / 401 / 404 -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-3", "soon"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
async def test_an_sla_header_that_is_no_positive_finite_number_is_400(engine, path, value):
    body = CHAT if path != "/generate" else {"prompt": "x", "max_tokens": 2}
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", path, body, headers={"x-velocity-sla-ms": value})
        assert r.status == 400 and error_of(r)["param"] == "sla_ms", (value, r.body)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", b"", None),
        ("/v1/chat/completions", b'{"model":"sim-model","messages":[]}', "messages"),
        (
            "/v1/chat/completions",
            b'{"model":"sim-model","messages":[{"role":"user","content":"x"}],"stream":"yes"}',
            "stream",
        ),
        ("/v1/completions", b'{"model":"sim-model","max_tokens":3}', "prompt"),
        ("/v1/completions", b'{"model":"sim-model","prompt":"x","max_tokens":0}', "max_tokens"),
        ("/v1/completions", b'{"model":"sim-model","prompt":"x","sla_ms":-5}', "sla_ms"),
        ("/generate", b'{"max_tokens":3}', "prompt"),
        ("/generate", b'{"prompt":"x","priority":"urgent"}', "priority"),
    ],
)
async def test_400_in_the_error_shape(engine, path, body, param):
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", path, body)
        assert r.status == 400
        err = error_of(r)
        assert err["param"] == param
        assert r.headers["x-request-id"].startswith("req-")
        assert "x-velocity-reject-reason" not in r.headers
        # bad input never takes the server down
        ok = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert ok.status == 200


async def test_401_on_every_path_but_health(engine):
    async with running_gateway(engine, api_key="k1", tenants=[{"name": "t", "api_key": "kt"}]) as gw:
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", CHAT),
            ("POST", "/generate", {"prompt": "x"}),
            ("GET", "/stats", None),
            ("GET", "/no/such/path", None),
        ]:
            r = await http_request(gw.port, method, path, body)
            assert r.status == 401, path
            assert error_of(r)["type"] == "AuthenticationError"
            wrong = await http_request(gw.port, method, path, body, headers={"authorization": "Bearer nope"})
            assert wrong.status == 401, path
        admin = await http_request(gw.admin_port, "GET", "/stats")
        assert admin.status == 401
        assert (await http_request(gw.port, "GET", "/health")).status == 200
        assert (await http_request(gw.admin_port, "GET", "/health")).status == 200
        for headers in (
            {"authorization": "Bearer k1"},
            {"x-api-key": "k1"},
            {"authorization": "bearer kt"},
            {"x-api-key": "kt"},
        ):
            r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT, headers=headers)
            assert r.status == 200, headers
        assert (await http_request(gw.admin_port, "GET", "/stats", headers={"x-api-key": "k1"})).status == 200


async def test_404_unknown_model_and_path(engine):
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", "/v1/chat/completions", dict(CHAT, model="nope"))
        assert r.status == 404
        err = error_of(r)
        assert err["param"] == "model" and "nope" in err["message"]
        assert "x-velocity-reject-reason" not in r.headers
        r = await http_request(gw.port, "POST", "/generate", {"prompt": "x", "model": "nope"})
        assert r.status == 404 and error_of(r)["param"] == "model"
        r = await http_request(gw.port, "GET", "/v2/whatever")
        assert r.status == 404
        error_of(r)
        r = await http_request(gw.admin_port, "GET", "/nothing-here")
        assert r.status == 404


async def test_missing_model_uses_the_default_pool(engine):
    async with running_gateway(engine) as gw:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
        assert r.status == 200
        assert r.json()["model"] == MODEL


# -- 408 / 413 / 431 from the `server:` section ------------------------------------------------------


async def test_408_slow_client_head_and_body(engine):
    server = {"header_timeout_s": 0.3, "body_timeout_s": 0.3}
    async with running_gateway(engine, server=server) as gw:
        out = await raw_exchange(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        assert out.startswith(b"HTTP/1.1 408 ")
        out = await raw_exchange(
            gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\":"
        )
        assert out.startswith(b"HTTP/1.1 408 ")
        assert b'"code":408' in out


async def test_413_and_431_limits(engine):
    server = {"max_body_bytes": 2048, "max_header_bytes": 2048}
    async with running_gateway(engine, server=server) as gw:
        big = dict(CHAT, messages=[{"role": "user", "content": "x" * 4000}])
        r = await http_request(gw.port, "POST", "/v1/chat/completions", big)
        assert r.status == 413
        assert error_of(r)
        r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT, headers={"x-filler": "y" * 4000})
        assert r.status == 431
        # just under the limits passes
        r = await http_request(
            gw.port, "POST", "/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": "x" * 1500}])
        )
        assert r.status == 200


# -- 429 / 502 / 503 ---------------------------------------------------------------------------------


async def test_429_tenant_rate_limit_by_header_tenant(engine):
    tenants = [{"name": "beta", "requests_per_second": 1.0, "burst": 2}]
    async with running_gateway(engine, tenants=tenants) as gw:
        statuses = []
        last = None
        for _ in range(4):
            last = await http_request(
                gw.port, "POST", "/v1/chat/completions", CHAT, headers={"x-velocity-tenant": "beta"}
            )
            statuses.append(last.status)
        assert statuses[:2] == [200, 200] and statuses[-1] == 429
        assert last.headers["x-velocity-reject-reason"] == "rate-limit"
        assert int(last.headers["retry-after"]) >= 1
        assert error_of(last)
        # another tenant is not limited by beta's bucket
        r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT, headers={"x-velocity-tenant": "gamma"})
        assert r.status == 200


async def test_503_no_endpoint_and_ready():
    dead = ("d1", f"http://127.0.0.1:{free_port()}", MODEL)
    async with running_gateway(dead, healthy=0) as gw:
        r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert r.status == 503
        assert r.headers["x-velocity-reject-reason"] == "no-endpoint"
        assert "retry-after" in r.headers
        error_of(r)
        ready = await http_request(gw.admin_port, "GET", "/ready")
        assert ready.status == 503
        health = (await http_request(gw.port, "GET", "/health")).json()
        assert health["status"] != "ok"
        assert (await http_request(gw.port, "GET", "/v1/models")).json()["data"] == []


def _kill(eng) -> None:
    eng.proc.kill()
    eng.proc.wait(5)


async def test_502_every_engine_refuses():
    e1 = start_sim_engine(model=MODEL, time_scale=50)
    e2 = start_sim_engine(model=MODEL, time_scale=50)
    try:
        # Health checks far apart: the gateway still believes both engines are up when they die.
        health = {"check_interval_ms": 60000.0, "scrape_interval_ms": 60000.0}
        async with running_gateway(e1, e2, health=health) as gw:
            _kill(e1)
            _kill(e2)
            r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
            assert r.status == 502
            assert r.headers["x-velocity-reject-reason"] == "upstream"
            error_of(r)
            assert all(not e.healthy for e in gw.endpoints.values()), "connect failures eject"
    finally:
        e1.stop()
        e2.stop()


async def test_one_engine_down_is_retried_on_the_other():
    e1 = start_sim_engine(model=MODEL, time_scale=50)
    e2 = start_sim_engine(model=MODEL, time_scale=50)
    try:
        health = {"check_interval_ms": 60000.0, "scrape_interval_ms": 60000.0}
        async with running_gateway(e1, e2, health=health) as gw:
            _kill(e1)
            dead = gw.endpoints["e1"]
            for _ in range(30):
                r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
                assert r.status == 200
                assert r.headers["x-velocity-endpoint"] == "e2"
                if not dead.healthy:
                    break
            assert not dead.healthy, "a request that met the dead engine was retried and ejected it"
    finally:
        e1.stop()
        e2.stop()


# -- what reaches the engine, and identity headers -----------------------------------------------------


async def test_gateway_fields_stripped_other_bytes_unchanged():
    async with RecordingUpstream() as up:
        async with running_gateway(("u1", up.url, MODEL)) as gw:
            plain = (
                b'{"model":  "sim-model", "messages":[{"role":"user","content":"h\\u00e9llo \xe2\x9c\x93"}],'
                b'\n "max_tokens": 3, "temperature": 0.5, "extra_vendor": {"a": [1, 2.50]}}'
            )
            r = await http_request(gw.port, "POST", "/v1/chat/completions", plain)
            assert r.status == 200
            assert up.requests[-1][3] == plain, "a body without gateway fields is forwarded byte for byte"

            own = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
                "priority": "high",
                "sla_ms": 1500,
                "user": "u-7",
                "seed": 11,
            }
            r = await http_request(gw.port, "POST", "/v1/chat/completions", own, headers={"x-request-id": "rid-fields"})
            assert r.status == 200, r.body
            method, path, headers, body = up.requests[-1]
            assert (method, path) == ("POST", "/v1/chat/completions")
            sent = json.loads(body)
            assert "priority" not in sent and "sla_ms" not in sent
            assert sent == {k: v for k, v in own.items() if k not in ("priority", "sla_ms")}
            assert headers["x-request-id"] == "rid-fields"
            assert r.headers["x-velocity-band"] == "high"

            r = await http_request(
                gw.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "p", "priority": 2, "max_tokens": 2}
            )
            assert r.status == 200
            assert "priority" not in json.loads(up.requests[-1][3])


async def test_vllm_priority_zero_runs_in_the_default_band(engine):
    """vLLM's priority: lower runs earlier, and 0 is its default, which clients written for
    vLLM send on every request. 0 is the default band (not the highest, where such a client
    would jump the line), each step one band up or down; the field never reaches the engine."""
    async with running_gateway(engine) as gw:
        got = {}
        for n in (-5, -1, 0, 1, 7):
            r = await http_request(gw.port, "POST", "/v1/chat/completions", dict(CHAT, priority=n))
            assert r.status == 200, r.body
            got[n] = r.headers["x-velocity-band"]
        assert got == {-5: "high", -1: "high", 0: "normal", 1: "low", 7: "low"}
        r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
        assert r.headers["x-velocity-band"] == "normal"  # as a request that names none


async def test_request_id_end_to_end_and_gateway_headers(engine):
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT, headers={"x-request-id": "abc-123"})
        assert r.status == 200
        assert r.headers["x-request-id"] == "abc-123"
        assert r.json()["id"] == "chatcmpl-abc-123"
        assert r.headers["x-velocity-endpoint"] == "e1"
        assert float(r.headers["x-velocity-queue-ms"]) >= 0.0
        assert r.headers["x-velocity-band"] == "normal"

        r = await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
        rid = r.headers["x-request-id"]
        assert re.fullmatch(r"req-[0-9a-f]{12}", rid)
        assert r.json()["id"] == f"chatcmpl-{rid}"

        r = await http_request(
            gw.port, "POST", "/v1/chat/completions", dict(CHAT, stream=True), headers={"x-velocity-priority": "low"}
        )
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-velocity-band"] == "low"
        assert re.fullmatch(r"req-[0-9a-f]{12}", r.headers["x-request-id"])
        assert r.body.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_a_request_naming_no_band_gets_default_band_and_an_unknown_band_is_400(engine, path, tmp_path):
    """docs/configuration.md, admission.default_band: the band of a request that names none;
    a band that does not exist is the client's mistake, shown as a 400 whether it came in
    the header or in the body (never run in another band). The default is live on reload."""
    from tests.support.gateway import gateway_settings
    from velocity_fast.gateway.reload import apply_settings

    body = {
        "/v1/chat/completions": CHAT,
        "/v1/completions": {"model": MODEL, "prompt": "x", "max_tokens": 2},
        "/generate": {"prompt": "x", "max_tokens": 2},
    }[path]
    async with running_gateway(engine, admission={"default_band": "low"}) as gw:
        r = await http_request(gw.port, "POST", path, body)
        assert r.status == 200 and r.headers["x-velocity-band"] == "low", r.body
        for headers, sent in (({"x-velocity-priority": "urgent"}, body), ({}, dict(body, priority="urgent"))):
            r = await http_request(gw.port, "POST", path, sent, headers=headers)
            assert r.status == 400, (headers, r.body)
            err = error_of(r)
            assert err["param"] == "priority"
            assert err["message"] == "Unknown priority band 'urgent'; bands are ['high', 'normal', 'low']."
        r = await http_request(gw.port, "POST", path, dict(body, priority="HIGH"))
        assert r.status == 200 and r.headers["x-velocity-band"] == "high"
        apply_settings(gw, gateway_settings(engine, admission={"default_band": "high"}))
        r = await http_request(gw.port, "POST", path, body)
        assert r.status == 200 and r.headers["x-velocity-band"] == "high"


# -- native route, health, stats, admin ------------------------------------------------------------------


async def test_generate_native_answer(engine):
    async with running_gateway(engine) as gw:
        r = await http_request(
            gw.port,
            "POST",
            "/generate",
            {"prompt": "Tell me a story", "max_tokens": 7, "priority": "high", "sla_ms": 60000},
            headers={"x-request-id": "gen-1"},
        )
        assert r.status == 200, r.body
        out = r.json()
        types = {
            "request_id": str,
            "response": str,
            "latency_seconds": float,
            "queue_time_seconds": float,
            "execution_time_seconds": float,
            "tokens_generated": int,
            "tokens_per_second": float,
            "sla_met": bool,
            "priority": str,
        }
        assert set(out) == set(types)
        for k, t in types.items():
            assert isinstance(out[k], t), (k, out[k])
        assert out["request_id"] == "gen-1"
        assert out["response"]
        assert out["tokens_generated"] == 7
        assert out["priority"] == "high"
        assert out["sla_met"] is True
        assert out["latency_seconds"] >= out["execution_time_seconds"] > 0
        assert out["tokens_per_second"] > 0

        s = await http_request(gw.port, "POST", "/generate", {"prompt": "stream it", "max_tokens": 5, "stream": True})
        assert s.status == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [e[len("data: ") :] for e in s.body.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert chunks[-1]["usage"]["completion_tokens"] == 5

        missed = (
            await http_request(gw.port, "POST", "/generate", {"prompt": "x", "max_tokens": 40, "sla_ms": 0.001})
        ).json()
        assert missed["sla_met"] is False


async def test_generate_runs_the_proxy_path_and_a_body_that_is_no_completion_is_502():
    """/generate goes through the same exchange as the OpenAI routes: the engine receives a
    completions request on /v1/completions without the gateway's own fields, with the
    request id; an engine 200 whose body is not a completion is a 502, counted as such."""
    async with RecordingUpstream(reply=b'{"not": "a completion"}') as up:
        async with running_gateway(("e1", up.url, "m")) as gw:
            r = await http_request(
                gw.port,
                "POST",
                "/generate",
                {"prompt": "hi", "max_tokens": 3, "priority": "high", "sla_ms": 5000},
                headers={"x-request-id": "gen-502"},
            )
            assert r.status == 502 and r.json()["error"]["code"] == 502, r.body
            assert r.headers["x-request-id"] == "gen-502" and r.headers["x-velocity-endpoint"] == "e1"
            (method, path, headers, body) = up.requests[-1]
            assert (method, path) == ("POST", "/v1/completions")
            assert headers["x-request-id"] == "gen-502"
            sent = json.loads(body)
            assert sent == {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": False}
            metrics = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
            assert 'velocity_requests_total{route="/generate",status="502",band="high"} 1.0' in metrics
            assert gw.admission.stats()["counters"]["failed"] == 1


async def test_health_and_stats_shapes(engine):
    async with running_gateway(engine) as gw:
        h = (await http_request(gw.port, "GET", "/health")).json()
        assert {"status", "policy", "backend", "model", "uptime_seconds"} <= set(h)
        assert h["status"] == "ok" and h["model"] == MODEL and h["policy"] == "dynamic"
        assert isinstance(h["uptime_seconds"], float)
        await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)
        for port in (gw.port, gw.admin_port):
            s = await http_request(port, "GET", "/stats")
            assert s.status == 200
            st = s.json()
            eps = {e["name"]: e for e in st["endpoints"]}
            assert eps["e1"]["healthy"] is True and eps["e1"]["served"] >= 1
            assert st["pools"] == {MODEL: ["e1"]}
        ready = await http_request(gw.admin_port, "GET", "/ready")
        assert ready.status == 200 and ready.json()["ready"] is True


async def test_admin_metrics_parse(engine):
    async with running_gateway(engine) as gw:
        for _ in range(3):
            assert (await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)).status == 200
        await http_request(gw.port, "POST", "/v1/chat/completions", b"{bad")
        r = await http_request(gw.admin_port, "GET", "/metrics")
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
        assert all(n.startswith("velocity_") for n in fams)
        for name in ("velocity_requests", "velocity_rejections", "velocity_ttft_seconds", "velocity_endpoint_healthy"):
            assert name in fams, name
        assert fams["velocity_ttft_seconds"].type == "histogram"
        assert any(f.type == "histogram" and ("latency" in n or "duration" in n) for n, f in fams.items()), (
            "an end-to-end latency histogram"
        )
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fams["velocity_requests"].samples}
        ok = [v for (n, lab), v in samples.items() if dict(lab).get("status") == "200"]
        bad = [v for (n, lab), v in samples.items() if dict(lab).get("status") == "400"]
        assert sum(ok) == 3 and sum(bad) == 1  # every answer counted once, the first as the rest
        chat_ok = {"route": "/v1/chat/completions", "status": "200", "band": "normal"}
        assert samples[("velocity_requests_total", tuple(sorted(chat_ok.items())))] == 3
        healthy = [s for s in fams["velocity_endpoint_healthy"].samples if s.labels["endpoint"] == "e1"]
        assert healthy[0].value == 1.0


async def test_ready_follows_engine_health():
    eng = start_sim_engine(model=MODEL, time_scale=50)
    try:
        async with running_gateway(eng) as gw:
            assert (await http_request(gw.admin_port, "GET", "/ready")).status == 200
            _kill(eng)

            async def not_ready():
                return (await http_request(gw.admin_port, "GET", "/ready")).status == 503

            await wait_until(not_ready, 5.0, what="/ready to answer 503")
    finally:
        eng.stop()


async def test_answered_requests_leave_nothing_for_the_cycle_collector(engine):
    # An exchange that referred to itself (a bound method kept on it) would live on
    # until a collection: the collector then runs more often and walks more objects.
    async with running_gateway(engine) as gw:
        assert (await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)).status == 200
        gc.collect()
        gc.disable()
        try:
            before = sum(type(o) is Exchange for o in gc.get_objects())
            for _ in range(30):
                assert (await http_request(gw.port, "POST", "/v1/chat/completions", CHAT)).status == 200
            left = sum(type(o) is Exchange for o in gc.get_objects()) - before
        finally:
            gc.enable()
        assert left < 3, f"{left} exchanges kept alive by reference cycles"


def _chat_of_size(n: int, spaced: bool, **extra) -> bytes:
    """A chat body of exactly n bytes (a long user turn padded to fit)."""
    obj = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": ""}],
        "max_tokens": 3,
        **extra,
    }
    dump = (
        (lambda o: json.dumps(o, ensure_ascii=False).encode())
        if spaced
        else (lambda o: json.dumps(o, separators=(",", ":"), ensure_ascii=False).encode())
    )
    short = len(dump(obj))
    obj["messages"][1]["content"] = ("Some \"quoted\" text, caf\u00e9, and a line.\n" * (n // 40 + 1))[: n - short]
    body = dump(obj)
    while len(body) > n:  # the escapes made it longer than its characters
        obj["messages"][1]["content"] = obj["messages"][1]["content"][: n - len(body) - 1]
        body = dump(obj)
    body = body[:-1] + b" " * (n - len(body)) + b"}"
    assert len(body) == n
    return body


@pytest.mark.timeout(60)
async def test_prompts_up_to_the_body_limit_pass_byte_for_byte_with_prefix_affinity_on():
    """With prefix affinity on (policy smart) a large body is scanned, not decoded: what
    reaches the engine is still the client's bytes, at 1 MiB and at the limit itself; one
    byte more is a 413; the gateway's own fields are cut out and nothing else changes."""
    limit = 3 * 1024 * 1024 + 17
    async with RecordingUpstream() as up:
        async with running_gateway(("u1", up.url, MODEL), policy="smart", server={"max_body_bytes": limit}) as gw:
            for n, spaced in ((1 << 20, False), (1 << 20, True), (limit, False)):
                body = _chat_of_size(n, spaced)
                r = await http_request(gw.port, "POST", "/v1/chat/completions", body)
                assert r.status == 200, r.body[:300]
                assert up.requests[-1][3] == body, f"a {n}-byte body is forwarded byte for byte"
            r = await http_request(gw.port, "POST", "/v1/chat/completions", _chat_of_size(limit + 1, False))
            assert r.status == 413 and error_of(r)
            own = _chat_of_size(1 << 20, True, priority="high", sla_ms=60000, seed=123456789012345678901234)
            r = await http_request(gw.port, "POST", "/v1/chat/completions", own)
            assert r.status == 200, r.body[:300]
            assert r.headers["x-velocity-band"] == "high"
            sent = up.requests[-1][3]
            assert json.loads(sent) == {k: v for k, v in json.loads(own).items() if k not in ("priority", "sla_ms")}
            assert b"123456789012345678901234" in sent  # as written: not decoded to a float
            bad = _chat_of_size(1 << 20, False)[:-1] + b",}"  # a trailing comma: malformed JSON
            before = len(up.requests)
            r = await http_request(gw.port, "POST", "/v1/chat/completions", bad)
            assert r.status == 400 and "not valid JSON" in error_of(r)["message"]
            assert len(up.requests) == before, "a malformed body never reaches the engine"


# -- the gateway's own headers, read where the scanner found them -------------------------------


def _post(headers: bytes, body: bytes, close: bool = False) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + headers
        + (b"Connection: close\r\n" if close else b"")
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def _answers(data: bytes) -> list[tuple[int, dict, bytes]]:
    """The answers in ``data``: (status, lower-case headers, body)."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(hdrs.get("content-length", 0))
        out.append((int(lines[0].split()[1]), hdrs, data[:n]))
        data = data[n:]
    return out


@pytest.mark.parametrize("close", [False, True])  # the scanner's request, or llhttp's (Connection: close)
async def test_gateway_headers_of_any_case_and_a_repeated_one_joined(engine, close):
    body = json.dumps(CHAT).encode()
    tenants = [{"name": "beta", "requests_per_second": 0.001, "burst": 1}]
    heads = [
        b"X-Request-Id: rid-7\r\nX-VELOCITY-PRIORITY: low\r\nX-Velocity-Tenant: beta\r\n",
        b"x-velocity-tenant: beta\r\n",  # beta's one request is spent: 429
        b"x-velocity-priority: high\r\nx-velocity-priority: low\r\n",  # the values joined: "high, low"
        b"x-velocity-profile: no-such-profile\r\n",
        b"x-session-id: s1\r\nx-velocity-other: 1\r\n",
    ]
    async with running_gateway(engine, tenants=tenants) as gw:
        got = []
        for head in heads:
            data = _post(head, body, close) + (b"" if close else b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
            got.append(_answers(await raw_exchange(gw.port, data))[0])
        (s1, h1, _), (s2, h2, _), (s3, _, b3), (s4, _, b4), (s5, h5, _) = got
        assert (s1, h1["x-request-id"], h1["x-velocity-band"]) == (200, "rid-7", "low")
        assert s2 == 429 and h2["x-velocity-reject-reason"] == "rate-limit"
        assert s3 == 400 and "'high, low'" in json.loads(b3)["error"]["message"]
        assert s4 == 400 and "no-such-profile" in json.loads(b4)["error"]["message"]
        assert s5 == 200 and h5["x-request-id"] not in ("", "rid-7")


async def test_tenants_named_by_header_in_turn_each_keep_their_own_bucket(engine):
    # The header's bytes find their tenant again without a look-up by name (Identity.by_header):
    # each must still be the tenant it names, in turn and repeated.
    body = json.dumps(CHAT).encode()
    tenants = [
        {"name": n, "requests_per_second": 0.001, "burst": 1} for n in ("a", "b", "a-long-tenant-name-past-8-bytes")
    ]
    async with running_gateway(engine, tenants=tenants) as gw:
        statuses = []
        for name in (b"a", b"b", b"a-long-tenant-name-past-8-bytes", b"nobody") * 2:
            data = (
                _post(b"x-velocity-tenant: " + name + b"\r\n", body)
                + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
            )
            statuses.append(_answers(await raw_exchange(gw.port, data))[0][0])
        assert statuses == [200, 200, 200, 200, 429, 429, 429, 200]
        assert {n: t.rejections for n, t in gw.identity.tenants.items()} == {
            "a": {"rate-limit": 1},
            "b": {"rate-limit": 1},
            "a-long-tenant-name-past-8-bytes": {"rate-limit": 1},
        }
