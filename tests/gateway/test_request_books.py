"""Every answer of the client port is in velocity_requests_total (the docs' "requests
answered by the gateway"): 401s, unknown routes (as route "other", however many paths a
scanner tries), wrong methods, /v1/models and /stats; and velocity_auth_failures_total
counts the keys refused on each port."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import running_gateway
from tests.support.sim import http_request, sim_engine

MODEL = "m1"
KEY = {"authorization": "Bearer k"}


def _requests(gw) -> dict:
    out = {}
    for fam in text_string_to_metric_families(gw.registry.render().decode()):
        for s in fam.samples:
            if s.name in ("velocity_requests_total", "velocity_auth_failures_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _req(route: str, status: int) -> tuple:
    return ("velocity_requests_total", (("band", "-"), ("route", route), ("status", str(status))))


def _auth(port: str) -> tuple:
    return ("velocity_auth_failures_total", (("port", port),))


async def test_refused_keys_unknown_routes_and_other_answers_are_counted():
    with sim_engine(model=MODEL, time_scale=10) as eng:
        async with running_gateway(eng, api_key="k") as gw:
            before = _requests(gw)
            assert before[_auth("client")] == 0 and before[_auth("admin")] == 0
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await http_request(gw.port, "POST", "/v1/chat/completions", chat)).status == 401
            bad = {"authorization": "Bearer nope"}
            assert (await http_request(gw.port, "GET", "/v1/models", headers=bad)).status == 401
            assert (await http_request(gw.port, "GET", "/wp-login.php")).status == 401
            for i in range(5):  # a scanner's paths: one series, not five
                assert (await http_request(gw.port, "GET", f"/scan/{i}", headers=KEY)).status == 404
            assert (await http_request(gw.port, "GET", "/v1/completions", headers=KEY)).status == 405
            assert (await http_request(gw.port, "GET", "/v1/models", headers=KEY)).status == 200
            assert (await http_request(gw.admin_port, "GET", "/metrics")).status == 401
            after = _requests(gw)
    assert after[_req("/v1/chat/completions", 401)] == 1
    assert after[_req("/v1/models", 401)] == 1
    assert after[_req("other", 401)] == 1
    assert after[_req("other", 404)] == 5
    assert after[_req("/v1/completions", 405)] == 1
    assert after[_req("/v1/models", 200)] == 1
    assert after[_auth("client")] == 3 and after[_auth("admin")] == 1
    routes = {dict(k[1])["route"] for k in after if k[0] == "velocity_requests_total"}
    assert not any(r.startswith("/scan") or r == "/wp-login.php" for r in routes), routes
