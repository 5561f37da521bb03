"""What a reload says: the keys that changed, by name down to the tenant and field; a change
that waits for a restart is not "no changes"; with workers, each line once per worker,
with its id."""

from __future__ import annotations

import logging
import re
import signal

from tests.support.gateway import gateway_process, gateway_settings, running_gateway, wait_until
from tests.support.sim import sim_engine
from velocity_fast.gateway.reload import Reloader

TENANTS = [{"name": "alice", "requests_per_second": 5.0}, {"name": "bob", "requests_per_second": 5.0}]


def _reload_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "velocity.reload"]


async def test_a_reload_names_the_keys_that_changed(caplog):
    caplog.set_level(logging.INFO, logger="velocity.reload")
    with sim_engine(model="m1", time_scale=10) as eng:
        async with running_gateway(eng, tenants=TENANTS) as gw:
            changed = [{"name": "alice", "requests_per_second": 9.0, "sla_ms": 800.0}, TENANTS[1]]
            assert await Reloader(gw, lambda: gateway_settings(eng, tenants=changed)).reload()
            (line,) = _reload_lines(caplog)
            assert line.startswith(
                "config reloaded: changed tenants.alice.requests_per_second, tenants.alice.sla_ms"
            ), line
            assert "bob" not in line

            caplog.clear()
            assert await Reloader(gw, lambda: gateway_settings(eng, tenants=changed, port=1)).reload()
            assert _reload_lines(caplog) == [
                "config reload: port changed; it takes effect at the next start",
                "config reloaded: port at the next start",
            ]

            caplog.clear()
            assert await Reloader(gw, lambda: gateway_settings(eng, tenants=changed)).reload()
            assert _reload_lines(caplog) == ["config reloaded: no changes"]


async def test_with_workers_each_reload_line_is_once_per_worker_with_its_id(tmp_path):
    cfg = tmp_path / "gw.yaml"
    with sim_engine(model="m1", time_scale=20) as eng:
        base = f'endpoints:\n  - {{name: e1, url: "{eng.url}", model: m1}}\n'
        cfg.write_text(base + "tenants:\n  - {name: alice, requests_per_second: 5}\n  - {name: bob}\n")
        with gateway_process("serve", "--config", str(cfg), "--workers", "2", timeout=40) as gp:
            cfg.write_text(base + "tenants:\n  - {name: alice, requests_per_second: 7, sla_ms: 900}\n  - {name: bob}\n")
            gp.proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: gp.stderr_text.count("config reloaded") >= 2, 15.0, what="both workers' lines")
            lines = [ln for ln in gp.stderr_text.splitlines() if "config reloaded" in ln]
            assert len(lines) == 2, lines
            who = [re.search(r" (worker \d+) velocity\.reload: config reloaded", ln) for ln in lines]
            assert all(who), lines
            assert sorted(m.group(1) for m in who) == ["worker 0", "worker 1"]
            assert all("changed tenants.alice.requests_per_second, tenants.alice.sla_ms" in ln for ln in lines)
