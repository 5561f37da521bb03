"""`velocityllm bench --no-request-sla`: no request carries an SLA of its own, the gateways
get --sla-ms as theirs; without the flag every request carries one, as before."""

import argparse

import orjson
import pytest

from velocity_fast.loadgen.bench_cmd import add_bench_arguments, bench_setup


def bench_args(*argv):
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return p.parse_args(["-n", "60", *argv])


def _slas(specs):
    """What each request says of an SLA: the header, and sla_ms anywhere in the body."""
    out = []
    for s in specs:
        body = orjson.loads(s.body)
        out.append(
            (
                s.headers.get("x-velocity-sla-ms"),
                body.get("sla_ms"),
                b"x-velocity-sla-ms" in s.wire.lower(),
                b"sla_ms" in s.wire,
            )
        )
    return out


@pytest.mark.parametrize("route", ["chat", "completions", "generate"])
def test_no_request_sla_sends_none(route):
    cfg, mix, specs, server_args = bench_setup(
        bench_args("--no-request-sla", "--route", route, "--bands", "high:1:1500,normal:2", "--sla-ms", "2500")
    )
    assert len(specs) == 60
    assert set(_slas(specs)) == {(None, None, False, False)}
    # Goodput is still judged by the SLAs, and the gateway is told the global one.
    assert {s.sla_ms for s in specs} == {1500.0, 2500.0}
    assert server_args == ["--sla-ms=2500"]


def test_by_default_every_request_carries_its_sla():
    cfg, mix, specs, server_args = bench_setup(bench_args("--bands", "high:1:1500,normal:2"))
    assert {s.headers["x-velocity-sla-ms"] for s in specs} == {"1500", "3000"}
    assert all(s.headers["x-velocity-sla-ms"] == str(int(s.sla_ms)) for s in specs)
    assert server_args == []


def test_an_sla_given_to_the_gateway_is_kept():
    *_, server_args = bench_setup(
        bench_args("--no-request-sla", "--server-arg=--sla-ms=1200", "--server-arg=--max-concurrency=8")
    )
    assert server_args == ["--sla-ms=1200", "--max-concurrency=8"]


def test_the_flag_is_in_the_help():
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    assert "--no-request-sla" in p.format_help()
