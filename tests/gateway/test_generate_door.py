"""/generate goes through the same front door as the OpenAI routes (gateway/ingress.pyx),
and so does /v1/messages from its pool on: the bad inputs the completions route refuses,
they refuse with the same answer (a missing or wrong key, a completion past the engines'
context, an unknown model or band, a tenant over its quota), and each refusal is counted
under its route the same way."""

from __future__ import annotations

import re

import orjson
import pytest

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import http_request, sim_engine

ROUTES = ("/v1/completions", "/generate", "/v1/messages")
KEY = {"authorization": "Bearer k-open", "content-type": "application/json"}
TIGHT = {"authorization": "Bearer k-tight", "content-type": "application/json"}


def _body(route: str, max_tokens: int, **extra) -> bytes:
    body = {"prompt": "hi", "max_tokens": max_tokens, **extra}
    if route == "/v1/messages":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    if route != "/generate":
        body.setdefault("model", "m1")
    return orjson.dumps(body)


def _error(r) -> dict:
    return orjson.loads(r.body)["error"]


def _counts(text: str, route: str) -> dict[int, float]:
    """velocity_requests_total of ``route`` by status, every band together."""
    out: dict[int, float] = {}
    for m in re.finditer(r'^velocity_requests_total\{([^}]*)\} (\S+)$', text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("route") == route:
            status = int(labels["status"])
            out[status] = out.get(status, 0.0) + float(m.group(2))
    return out


@pytest.mark.timeout(60)
async def test_generate_refuses_what_completions_refuses_the_same_way():
    tenants = [
        {"name": "open", "api_key": "k-open"},
        # 50 tokens a minute: a full bucket lets one request of 100 out go into debt, and
        # the debt refuses every request after it for the test's length
        {"name": "tight", "api_key": "k-tight", "tokens_per_minute": 50},
    ]
    with sim_engine(model="m1", time_scale=50) as eng:
        async with running_gateway(eng, tenants=tenants) as gw:
            await wait_until(
                lambda: all(e.max_model_len for e in gw.endpoints.values()), 5.0, what="the engine's context length"
            )
            r = await http_request(gw.port, "POST", "/v1/completions", _body("", 100), TIGHT, timeout=30)
            assert r.status == 200, r.body
            seen: dict[str, list] = {}
            for route in ROUTES:
                got = seen[route] = []
                # No key, a wrong key: 401 before anything is read.
                r = await http_request(gw.port, "POST", route, _body(route, 8), {"content-type": "application/json"})
                got.append((r.status, _error(r)["type"]))
                r = await http_request(
                    gw.port,
                    "POST",
                    route,
                    _body(route, 8),
                    {"authorization": "Bearer nope", "content-type": "application/json"},
                )
                got.append((r.status, _error(r)["type"]))
                # Past the engine's context (the sim engine's 4096): vLLM's 400, naming the field.
                r = await http_request(gw.port, "POST", route, _body(route, 4096), KEY)
                err = _error(r)
                got.append((r.status, err["param"], "maximum context length is 4096 tokens" in err["message"]))
                # A model no pool serves: 404 naming it.
                r = await http_request(gw.port, "POST", route, _body(route, 8, model="nope"), KEY)
                err = _error(r)
                got.append((r.status, err["type"], err["param"], err["message"]))
                # A band that does not exist: 400 naming the bands.
                r = await http_request(
                    gw.port, "POST", route, _body(route, 8), {**KEY, "x-velocity-priority": "urgent"}
                )
                err = _error(r)
                got.append((r.status, err["param"], err["message"]))
                # A tenant over its tokens per minute: 429 rate-limit, told when to come back.
                r = await http_request(gw.port, "POST", route, _body(route, 100), TIGHT)
                got.append(
                    (
                        r.status,
                        r.headers.get("x-velocity-reject-reason"),
                        "retry-after" in r.headers,
                        _error(r)["message"],
                    )
                )
            assert seen["/generate"] == seen["/v1/completions"] == seen["/v1/messages"]
            assert [g[0] for g in seen["/generate"]] == [401, 401, 400, 404, 400, 429]
            assert seen["/generate"][2][1:] == ("max_tokens", True)
            assert gw.identity.tenants["tight"].rejections == {"rate-limit": 3}
            # Every refusal counted under its own route, the same for both.
            text = (await http_request(gw.admin_port, "GET", "/metrics", None, KEY)).body.decode()
            refused = {s: n for s, n in _counts(text, "/v1/completions").items() if s >= 400}
            assert _counts(text, "/generate") == _counts(text, "/v1/messages") == refused
            assert refused == {401: 2, 400: 2, 404: 1, 429: 1}
