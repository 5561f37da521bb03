"""gateway/workers.py: the workers' orders, and the supervisor's admin /metrics merging what
each metric declared, with no table of its own."""

from __future__ import annotations

import os

from tests.support.gateway import running_gateway
from tests.support.server_wire import connect, serving
from velocity_fast.config import EndpointConfig, load_settings
from velocity_fast.gateway.app import Gateway
from velocity_fast.gateway.workers import WorkerSupervisor, worker_count, worker_side
from velocity_fast.metrics.registry import MAX, MEAN, MIN, SUM

NOWHERE = ("e1", "http://127.0.0.1:9", "m1")  # no engine is needed: only the admin ports are read


def test_every_metric_a_gateway_registers_declares_its_merge():
    settings = load_settings(
        None,
        {
            "endpoints": [EndpointConfig(name="e1", url="http://127.0.0.1:9", model="m")],
            "tenants": [{"name": "t", "tokens_per_minute": 100}],
        },
        env={},
    )
    gw = Gateway(settings)
    names = {line.split(" ")[2] for line in gw.registry.render().decode().splitlines() if line.startswith("# TYPE ")}
    assert names and sorted(n for n in names if gw.registry.get(n).merge is None) == [], (
        "metrics registered without merge= (how the workers' values add up)"
    )


class _Running:
    """A worker's process as the supervisor sees one that serves (the admin port is a real one)."""

    pid = os.getpid()

    def poll(self):
        return None


async def test_a_new_metric_merges_across_two_workers_by_its_declared_rule():
    """Two gateways serve their admin ports as two workers do; on each, metrics no code of
    the supervisor names are declared as any package declares one, each with its rule; the
    supervisor's /metrics, read from the workers over loopback, merges each by that rule."""
    async with running_gateway(NOWHERE, healthy=0) as a, running_gateway(NOWHERE, healthy=0) as b:
        for gw, v in ((a, 3.0), (b, 7.0)):
            reg = gw.registry
            reg.gauge("velocity_test_whole", "The same whole in every worker.", merge=MAX).set(v)
            reg.gauge("velocity_test_floor", "The smallest is the one to trust.", merge=MIN).set(v)
            reg.gauge("velocity_test_share", "Measured by each worker alone.", merge=MEAN).set(v)
            reg.counter("velocity_test_events_total", "Each worker's own.", ("kind",), merge=SUM).labels("x").inc(v)
        sup = WorkerSupervisor(a.settings, [], 2)
        for w, gw in zip(sup.workers, (a, b)):
            w.admin_port, w.proc = gw.admin_port, _Running()
        async with serving(sup.handle_admin) as srv, connect(srv) as conn:
            r = await conn.request("GET", "/metrics")
            st = await conn.request("GET", "/stats")
        limit = a.endpoints["e1"].limit
    assert r.status == 200
    text = r.body.decode()
    got = {
        k: float(v)
        for line in text.splitlines()
        if line.startswith("velocity_test_")
        for k, _, v in [line.rpartition(" ")]
    }
    assert got == {
        "velocity_test_whole": 7.0,
        "velocity_test_floor": 3.0,
        "velocity_test_share": 5.0,
        'velocity_test_events_total{kind="x"}': 10.0,
    }
    assert 'velocity_endpoint_healthy{endpoint="e1",model="m1"} 0.0' in text
    assert "# MERGE" not in text and "velocity_workers 2.0" in text
    # /stats: an endpoint's limit is every worker's whole (declared so), its served counts add up.
    stats = st.json()
    assert st.status == 200 and stats["endpoints"][0]["limit"] == limit and stats["endpoints"][0]["served"] == 0
    assert "merge" not in stats and all("merge" not in p for p in stats["per_worker"])


def test_worker_count_and_the_workers_orders():
    assert worker_count(load_settings(None, {"workers": "3"}, env={})) == 3
    assert worker_count(load_settings(None, {"workers": "auto"}, env={})) >= 1
    assert worker_side({}) is None
    side = worker_side(
        {
            "VELOCITY_WORKER": "1",
            "VELOCITY_SHARED": "/dev/shm/x",
            "VELOCITY_WORKER_PORT": "8000",
            "VELOCITY_WORKER_FD": "7",
        }
    )
    assert (side.index, side.shared, side.port, side.report_fd) == (1, "/dev/shm/x", 8000, 7)
