"""Live reload by SIGHUP while requests flow: each reloadable key's new value acts on new
requests (band ceilings, queue capacities and TTLs, the admission section, api_key, a
tenant's max_band and rate, models' profiles, routing), and a key that needs a restart is
reported in a warning and keeps its old value until then.

The gateway runs in this process; the test sends SIGHUP to it, and the Reloader installed
on the loop re-reads the config file, as `velocityllm serve` does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

import pytest

from tests.knobs.knob_support import GaugeEngine, completion
from tests.support.gateway import FAST_HEALTH, gateway_settings, running_gateway, wait_until
from tests.support.sim import http_request
from velocity_fast.gateway.reload import Reloader

BANDS = """
bands:
  - {{name: high, ceiling: 1.5}}
  - {{name: normal, ceiling: {normal_ceiling}, queue_capacity: {normal_capacity}, ttl_ms: {normal_ttl}}}
  - {{name: low, ceiling: 0.8}}
"""


class Live:
    """A gateway in this process reloading ``cfg`` on SIGHUP, with steady background traffic
    (high band, which no change here holds back) whose statuses are kept."""

    def __init__(self, gw, cfg, engines, headers: dict | None = None) -> None:
        self.gw, self.cfg = gw, cfg
        self.reloader = Reloader(gw, lambda: gateway_settings(*engines, config_file=str(cfg)))
        self.headers = {"x-velocity-priority": "high", **(headers or {})}
        self.statuses: list[int] = []
        self._stop = asyncio.Event()
        self._go = asyncio.Event()
        self._go.set()
        self._busy = 0
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Live":
        self.reloader.install()
        self._tasks = [asyncio.create_task(self._traffic()) for _ in range(2)]
        await wait_until(lambda: len(self.statuses) >= 4, 10.0, what="traffic flowing")
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self.reloader.close()

    async def _traffic(self, max_requests: int = 4000, deadline_s: float = 60.0) -> None:
        # Paced (at most 50 a second per loop): the bound on the count must outlast any test.
        t_end = time.monotonic() + deadline_s
        while not self._stop.is_set() and len(self.statuses) < max_requests and time.monotonic() < t_end:
            await self._go.wait()
            self._busy += 1
            try:
                self.statuses.append((await completion(self.gw.port, self.headers)).status)
            finally:
                self._busy -= 1
            await asyncio.sleep(0.02)

    @contextlib.asynccontextmanager
    async def quiet(self):
        """No background request in flight inside: a routing figure read here sees idle
        engines. (Two loops in flight beside a sequential client fall into step with it,
        and the shortest queue then sends every one of its requests to the same engine.)"""
        self._go.clear()
        try:
            await wait_until(lambda: self._busy == 0, 10.0, what="background traffic paused")
            yield
        finally:
            self._go.set()

    async def sighup(self, text: str) -> None:
        """Write the config file, send SIGHUP, wait until the reload was applied."""
        self.cfg.write_text(text)
        done = self.reloader.reloads
        before = len(self.statuses)
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_until(lambda: self.reloader.reloads > done or self.reloader.refused, 10.0, what="the reload")
        assert self.reloader.refused == 0
        # Traffic went on across the reload, none of it lost.
        assert len(self.statuses) < 4000 and not any(t.done() for t in self._tasks), "traffic ended early"
        await wait_until(lambda: len(self.statuses) >= before + 4, 10.0, what="traffic after the reload")
        assert set(self.statuses) == {200}, self.statuses


def _bands(ceiling=1.0, capacity=1000, ttl=30000) -> str:
    return BANDS.format(normal_ceiling=ceiling, normal_capacity=capacity, normal_ttl=ttl)


async def test_band_ceiling_capacity_and_ttl_act_on_new_requests_after_sighup(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(_bands(ceiling=1.0, capacity=1, ttl=400))
    async with GaugeEngine(kv=0.9) as eng:  # pool saturated: normal (ceiling 1.0) waits, high goes
        s = gateway_settings(("a", eng.url, "m1"), config_file=str(cfg), policy="dynamic")
        async with running_gateway(settings=s) as gw:
            await wait_until(lambda: gw.endpoints["a"].kv_usage == 0.9, 5.0, what="scraped")
            async with Live(gw, cfg, [("a", eng.url, "m1")]) as live:
                normal = {"x-velocity-priority": "normal"}
                # Before: one waits, the next finds the queue full, the first times out.
                first = asyncio.create_task(completion(gw.port, normal))
                await wait_until(lambda: gw.admission.stats()["queued"] == 1, 5.0, what="one queued")
                full = await completion(gw.port, normal)
                assert (full.status, full.headers["x-velocity-reject-reason"]) == (503, "capacity")
                r = await first
                assert (r.status, r.headers["x-velocity-reject-reason"]) == (504, "ttl")

                # Capacity 5 and a TTL of a minute: three wait, none is refused or expires.
                await live.sighup(_bands(ceiling=1.0, capacity=5, ttl=60000))
                waiting = [asyncio.create_task(completion(gw.port, normal, timeout=30)) for _ in range(3)]
                await wait_until(lambda: gw.admission.stats()["queued"] == 3, 5.0, what="three queued")
                await asyncio.sleep(0.8)  # twice the old TTL
                assert not any(t.done() for t in waiting)

                # A ceiling of 1.5: normal is no longer held back, new requests go at once.
                await live.sighup(_bands(ceiling=1.5, capacity=5, ttl=60000))
                r = await completion(gw.port, normal)
                assert r.status == 200 and r.headers["x-velocity-band"] == "normal"
                # The three wait in the retired controller under the old ceiling until room.
                assert not any(t.done() for t in waiting)
                eng.kv = 0.1
                assert [(await t).status for t in waiting] == [200] * 3


async def test_admission_section_acts_on_new_requests_after_sighup(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("admission: {kv_threshold: 0.8}\n")
    async with GaugeEngine(kv=0.9) as eng:
        s = gateway_settings(("a", eng.url, "m1"), config_file=str(cfg), policy="dynamic")
        async with running_gateway(settings=s) as gw:
            await wait_until(lambda: gw.endpoints["a"].kv_usage == 0.9, 5.0, what="scraped")
            async with Live(gw, cfg, [("a", eng.url, "m1")]) as live:
                held = asyncio.create_task(completion(gw.port, timeout=30))
                await wait_until(lambda: gw.admission.stats()["queued"] == 1, 5.0, what="held")
                # KV past 0.8 saturates the engine; at 0.95 it does not.
                await live.sighup("admission: {kv_threshold: 0.95}\n")
                r = await completion(gw.port)
                assert r.status == 200
                assert gw.admission.settings.kv_threshold == 0.95
                assert gw.admission.stats()["pools"]["m1"]["saturation"] < 1.0
                assert not held.done()  # the old controller keeps its own threshold
                eng.kv = 0.1
                assert (await held).status == 200


async def test_api_key_and_tenant_max_band_and_rate_act_after_sighup(tmp_path):
    cfg = tmp_path / "gw.yaml"
    before = """
api_key: key-one
tenants:
  - {name: t, api_key: key-t, max_band: normal, requests_per_second: 0.001, burst: 1}
  - {name: bg, api_key: key-bg}
"""
    after = """
api_key: key-two
tenants:
  - {name: t, api_key: key-t, max_band: null, requests_per_second: 1000, burst: 100}
  - {name: bg, api_key: key-bg}
"""
    cfg.write_text(before)
    async with GaugeEngine() as eng:
        s = gateway_settings(("a", eng.url, "m1"), config_file=str(cfg), policy="dynamic")
        async with running_gateway(settings=s) as gw:
            async with Live(gw, cfg, [("a", eng.url, "m1")], {"authorization": "Bearer key-bg"}) as live:
                t = {"authorization": "Bearer key-t", "x-velocity-priority": "high"}
                assert (await completion(gw.port, {"authorization": "Bearer key-one"})).status == 200
                assert (await completion(gw.port, {"authorization": "Bearer key-two"})).status == 401
                r = await completion(gw.port, t)
                assert r.status == 200 and r.headers["x-velocity-band"] == "normal"  # capped
                r = await completion(gw.port, t)
                assert (r.status, r.headers["x-velocity-reject-reason"]) == (429, "rate-limit")

                await live.sighup(after)
                assert (await completion(gw.port, {"authorization": "Bearer key-one"})).status == 401
                assert (await completion(gw.port, {"authorization": "Bearer key-two"})).status == 200
                for _ in range(5):  # the new rate, and no cap
                    r = await completion(gw.port, t)
                    assert r.status == 200 and r.headers["x-velocity-band"] == "high"

                await live.sighup(before)  # and back: the slow rate with a fresh bucket of 1
                assert (await completion(gw.port, t)).status == 200
                r = await completion(gw.port, t)
                assert (r.status, r.headers["x-velocity-reject-reason"]) == (429, "rate-limit")


PROMPT = "You are a careful assistant who answers in one line. " * 4  # 4 blocks and more


async def _endpoints_used(gw, n: int = 12) -> set[str]:
    """The engines that served n sequential requests with the same prompt."""
    used = set()
    for _ in range(n):
        r = await completion(gw.port, prompt=PROMPT)
        assert r.status == 200
        used.add(r.headers["x-velocity-endpoint"])
    return used


async def test_models_profile_and_routing_act_after_sighup(tmp_path):
    cfg = tmp_path / "gw.yaml"
    # static throughout: the routing keys alone decide (with dynamic, admission's own KV
    # threshold would also keep a band off an engine it counts as saturated).
    cfg.write_text("policy: static\nrouting: {seed: 3}\nmodels: {m1: {profile: batch}}\n")
    async with GaugeEngine() as a, GaugeEngine() as b:
        engines = [("a", a.url, "m1"), ("b", b.url, "m1")]
        s = gateway_settings(*engines, config_file=str(cfg), policy="static")
        async with running_gateway(settings=s) as gw:
            async with Live(gw, cfg, engines) as live:
                # batch: shortest queue, ties at random: both idle engines serve (24 draws:
                # all on one engine by chance once in 2**23).
                async with live.quiet():
                    assert await _endpoints_used(gw, 24) == {"a", "b"}
                # chat: the same prompt sticks to the engine that has its prefix.
                await live.sighup("policy: static\nrouting: {seed: 3}\nmodels: {m1: {profile: chat}}\n")
                assert len(await _endpoints_used(gw)) == 1
                # routing: a at 90 % KV is filtered as saturated at 0.8, not at 0.95.
                await live.sighup(
                    "policy: static\nrouting: {seed: 3, saturation_kv: 0.8}\nmodels: {m1: {profile: batch}}\n"
                )
                a.kv, b.waiting = 0.9, 2
                await wait_until(
                    lambda: gw.endpoints["a"].kv_usage == 0.9 and gw.endpoints["b"].waiting == 2, 5.0, what="scraped"
                )
                # Read with the background paused, as above: a's own in-flight background
                # requests can make it the longer queue (b shows 2 waiting), and a fresh
                # clone's CI saw {a, b} here.
                async with live.quiet():
                    assert await _endpoints_used(gw, 6) == {"b"}
                await live.sighup(
                    "policy: static\nrouting: {seed: 3, saturation_kv: 0.95}\nmodels: {m1: {profile: batch}}\n"
                )
                async with live.quiet():
                    assert await _endpoints_used(gw, 6) == {"a"}


async def test_keys_that_need_a_restart_are_reported_and_keep_their_value(tmp_path, caplog):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("server: {max_body_bytes: 1000000}\n")
    async with GaugeEngine() as eng:
        s = gateway_settings(("a", eng.url, "m1"), config_file=str(cfg), policy="static")
        async with running_gateway(settings=s) as gw:
            async with Live(gw, cfg, [("a", eng.url, "m1")]) as live:
                with caplog.at_level(logging.WARNING, logger="velocity.reload"):
                    await live.sighup("server: {max_body_bytes: 200}\n")
                warnings = [
                    r.getMessage()
                    for r in caplog.records
                    if r.name == "velocity.reload" and r.levelno == logging.WARNING
                ]
                assert warnings == ["config reload: server.max_body_bytes changed; it takes effect at the next start"]
                # The running server keeps the limit it started with: a 2 KB body is not a 413.
                r = await completion(gw.port, prompt="x" * 2000)
                assert r.status == 200


@pytest.mark.parametrize(
    "key", ["host", "port", "admin_port", "health", "sim", "model_path", "structured_logs", "log_level"]
)
async def test_each_restart_key_is_named_in_the_warning(tmp_path, caplog, key):
    from velocity_fast.gateway.reload import RESTART_KEYS, apply_settings

    assert key in RESTART_KEYS
    value = {
        "host": "127.0.0.2",
        "port": 1,
        "admin_port": 2,
        "health": {**FAST_HEALTH, "check_interval_ms": 999.0},
        "sim": {"decode_tps": 7.0},
        "model_path": str(tmp_path),
        "structured_logs": True,
        "log_level": "debug",
    }[key]
    async with GaugeEngine() as eng:
        async with running_gateway(("a", eng.url, "m1"), policy="static") as gw:
            new = gateway_settings(("a", eng.url, "m1"), policy="static", **{key: value})
            with caplog.at_level(logging.WARNING, logger="velocity.reload"):
                apply_settings(gw, new)
            warned = [r.getMessage() for r in caplog.records if r.name == "velocity.reload"]
            # Named down to the key that changed, as the file writes it.
            path = {"health": "health.check_interval_ms changed", "sim": "sim.decode_tps added"}.get(
                key, f"{key} changed"
            )
            assert warned == [f"config reload: {path}; it takes effect at the next start"]
            assert (await http_request(gw.port, "GET", "/health")).status == 200


async def test_a_restart_key_set_back_to_its_running_value_is_not_reported(caplog):
    """log_level changed to debug (reported: it applies at the next start), then back to
    the info the gateway runs with: nothing to report, and again a change after that."""
    from velocity_fast.gateway.reload import apply_settings

    async with GaugeEngine() as eng:
        async with running_gateway(("a", eng.url, "m1"), policy="static", log_level="info") as gw:
            warned = []
            for level in ("debug", "info", "info", "warning"):
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="velocity.reload"):
                    apply_settings(gw, gateway_settings(("a", eng.url, "m1"), policy="static", log_level=level))
                warned.append([r.getMessage() for r in caplog.records if r.name == "velocity.reload"])
            change = ["config reload: log_level changed; it takes effect at the next start"]
            assert warned == [change, [], [], change]


async def test_the_servers_sla_acts_on_new_requests_after_sighup(tmp_path):
    """sla_ms is live: a request without its own SLA queued under the old one is served;
    after the reload, the same request on a full pool is declined against the new one."""
    from tests.support.sim import sim_engine
    from velocity_fast.gateway.reload import Reloader

    cfg = tmp_path / "gw.yaml"
    cfg.write_text("sla_ms: 60000\nmax_concurrency: 1\n")
    long_sla = {"x-velocity-sla-ms": "60000"}
    with sim_engine(model="m1", time_scale=4) as eng:
        s = gateway_settings(eng, config_file=str(cfg), policy="dynamic")
        async with running_gateway(settings=s) as gw:
            reloader = Reloader(gw, lambda: gateway_settings(eng, config_file=str(cfg), policy="dynamic"))
            reloader.install()
            try:
                for _ in range(3):  # about 0.2 s a request, learned
                    assert (await completion(gw.port, max_tokens=40)).status == 200
                busy = asyncio.create_task(completion(gw.port, long_sla, max_tokens=200, timeout=30))
                await wait_until(lambda: gw.admission.stats()["counters"]["in_flight"] == 1, 5.0, what="busy")
                queued = asyncio.create_task(completion(gw.port, max_tokens=40, timeout=30))
                await wait_until(lambda: gw.admission.stats()["queued"] == 1, 5.0, what="queued under 60 s")

                cfg.write_text("sla_ms: 100\nmax_concurrency: 1\n")
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_until(lambda: reloader.reloads == 1, 10.0, what="the reload")
                assert gw.admission.settings.sla_ms == 100
                assert (await busy).status == 200 and (await queued).status == 200
                for _ in range(2):  # the new controller learns the engine's pace again
                    assert (await completion(gw.port, long_sla, max_tokens=40)).status == 200
                busy = asyncio.create_task(completion(gw.port, long_sla, max_tokens=200, timeout=30))
                await wait_until(lambda: gw.admission.stats()["counters"]["in_flight"] == 1, 5.0, what="busy")
                r = await completion(gw.port, max_tokens=40)
                assert (r.status, r.headers["x-velocity-reject-reason"]) == (429, "sla")
                assert (await completion(gw.port, long_sla, max_tokens=40, timeout=30)).status == 200
                assert (await busy).status == 200
            finally:
                reloader.close()
