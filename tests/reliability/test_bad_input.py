"""Bad input never becomes a 500, and what still fails inside the gateway is a counted,
logged 500 that carries the request id.

Each cause once seen as a 500 has its test: JSON nested past the decoder's depth on every
route, token counts out of range (C long and orjson overflow), /generate without sla_ms;
then an internal error provoked on purpose, read back from the answer and /metrics."""

from __future__ import annotations

import logging

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import running_gateway
from tests.support.sim import http_request, sim_engine
from velocity_fast.gateway.request_types import MAX_TOKENS_LIMIT

MODEL = "sim-model"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


def base(route: str) -> dict:
    if route == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if route == COMPLETIONS:
        return {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    return {"prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def engine():
    with sim_engine(model=MODEL, time_scale=50) as eng:
        yield eng


async def metric_samples(gw, name: str) -> dict[tuple, float]:
    text = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def assert_error_shape(r, status: int, param=None) -> dict:
    assert r.status == status, (r.status, r.body[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    "route, where",
    [(CHAT, "unknown"), (COMPLETIONS, "unknown"), (GENERATE, "unknown"), (CHAT, "field"), (COMPLETIONS, "field")],
)
async def test_json_nested_past_the_depth_is_a_400(engine, route, where):
    deep = "[" * 1000 + "]" * 1000
    if where == "unknown":  # a field the gateway does not read (skipped by the decoder)
        b = base(route)
        b["extra"] = None
        body = orjson.dumps(b).replace(b"null", deep.encode())
    else:  # inside the field the route reads (messages is kept raw, prompt decoded; /generate's is a str)
        field = "messages" if route == CHAT else "prompt"
        body = ('{"model": "%s", "%s": %s}' % (MODEL, field, deep)).encode()
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", route, body)
        err = assert_error_shape(r, 400)
        assert "nested too deeply" in err["message"]
        assert r.headers.get("x-request-id")
        # 50 levels is an ordinary body: answered (by the engine or as a 400 for its type)
        ok = dict(base(route))
        r = await http_request(gw.port, "POST", route, ok)
        assert r.status == 200, r.body[:300]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, GENERATE])
async def test_token_counts_out_of_range_are_400s_naming_the_field(engine, route):
    fields = ["max_tokens"] + (["max_completion_tokens"] if route == CHAT else [])
    values = [
        2**63,
        2**63 - 1,
        2**64,
        10**30,
        MAX_TOKENS_LIMIT + 1,
        -1,
        0,
        -(2**63) - 1,
        1.5,
        1e300,
        True,
        "5",
        [5],
        {"n": 5},
    ]
    async with running_gateway(engine) as gw:
        for field in fields:
            for v in values:
                body = base(route)
                body[field] = v
                r = await http_request(gw.port, "POST", route, body)
                assert_error_shape(r, 400, param=field)
        body = base(route)
        body[fields[-1]] = MAX_TOKENS_LIMIT  # the bound itself is accepted (the engine may refuse it)
        r = await http_request(gw.port, "POST", route, body)
        assert r.status != 500 and r.status < 500, r.body[:300]
        r = await http_request(gw.port, "POST", route, base(route))
        assert r.status == 200
        served = await metric_samples(gw, "velocity_requests_total")
        assert not any(dict(k)["status"] == "500" for k in served), served


async def test_generate_without_sla_ms_is_answered(engine):
    async with running_gateway(engine) as gw:
        r = await http_request(gw.port, "POST", GENERATE, {"prompt": "hello", "max_tokens": 3})
        assert r.status == 200, r.body[:300]
        out = r.json()
        assert isinstance(out["sla_met"], bool) and out["tokens_generated"] == 3


@pytest.mark.parametrize("route", [CHAT, GENERATE])
async def test_an_internal_error_is_a_counted_500_with_the_request_id(engine, route, monkeypatch, caplog):
    """A gateway step made to raise: the client gets the error shape with the request id
    (header and message), /metrics counts it in both counters, the log has it once with
    its traceback, and the next request is served."""
    async with running_gateway(engine) as gw:
        before = await metric_samples(gw, "velocity_internal_errors_total")
        assert before.get(((("route", route)),)) == 0.0  # the series exists before any error

        def broken(*a, **k):
            raise RuntimeError("provoked for the test")

        # x-velocity-sla-ms makes both routes call Gateway.sla_for
        monkeypatch.setattr(gw, "sla_for", broken)
        with caplog.at_level(logging.ERROR, logger="velocity"):
            r = await http_request(
                gw.port,
                "POST",
                route,
                base(route),
                headers={"x-request-id": "rid-provoked-1", "x-velocity-sla-ms": "500"},
            )
            err = assert_error_shape(r, 500)
            assert r.headers["x-request-id"] == "rid-provoked-1"
            assert "rid-provoked-1" in err["message"]
            r = await http_request(gw.port, "POST", route, base(route), headers={"x-velocity-sla-ms": "500"})
            assert_error_shape(r, 500)
            rid = r.headers["x-request-id"]
            assert rid.startswith("req-") and rid in r.json()["error"]["message"]
        logged = [rec for rec in caplog.records if "rid-provoked-1" in rec.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info and "provoked for the test" in caplog.text
        internal = await metric_samples(gw, "velocity_internal_errors_total")
        assert internal[(("route", route),)] == 2.0
        total = await metric_samples(gw, "velocity_requests_total")
        assert sum(v for k, v in total.items() if dict(k)["status"] == "500" and dict(k)["route"] == route) == 2.0
        monkeypatch.undo()
        r = await http_request(gw.port, "POST", route, base(route))
        assert r.status == 200


async def test_a_failure_in_an_engine_callback_is_a_counted_500(monkeypatch, caplog):
    """The exchange's own callbacks (the engine's answer arrives): a step that raises there
    ends the lease and answers a counted 500 with the request id, not a stranded client."""
    with sim_engine("--fail-rate", "1.0", model=MODEL, time_scale=50) as eng:
        async with running_gateway(eng) as gw:

            def broken(*a, **k):
                raise RuntimeError("provoked in the answer's books")

            monkeypatch.setattr(gw.monitor, "passive_failure", broken)
            with caplog.at_level(logging.ERROR, logger="velocity"):
                r = await http_request(gw.port, "POST", CHAT, base(CHAT), headers={"x-request-id": "rid-cb"})
            err = assert_error_shape(r, 500)
            assert r.headers["x-request-id"] == "rid-cb" and "rid-cb" in err["message"]
            assert "provoked in the answer's books" in caplog.text
            internal = await metric_samples(gw, "velocity_internal_errors_total")
            assert internal[(("route", CHAT),)] == 1.0
            monkeypatch.undo()
            text = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            adm = sum(s.value for s in fams["velocity_admitted"].samples)
            ended = sum(s.value for n in ("completed", "failed", "cancelled") for s in fams[f"velocity_{n}"].samples)
            assert adm == ended == 1.0
