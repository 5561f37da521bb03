"""Tenant limits across replicas (state_store): two `velocityllm serve` processes in front
of one sim engine share a real redis-server on a loopback port. Clients over the limit on
both replicas: the admitted rate is the tenant's, not twice it; with Redis stopped the
requests still flow under each replica's local limit and none waits on the store; when it
is back the shared limit holds again. The same for tokens_per_minute, and a bad
state_store is refused at start with the key named."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack, contextmanager

import pytest

from tests.support.gateway import GatewayProcess, gateway_process
from tests.support.redis_server import redis_server
from tests.support.sim import http_request, sim_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

MODEL = "sim-model"
BODY = {"model": MODEL, "prompt": "hello from a tenant", "max_tokens": 8}
HEADERS = {"x-velocity-tenant": "t", "x-velocity-sla-ms": "600000"}


@pytest.fixture(scope="module")
def engine():
    with sim_engine("--decode-tps", "2000", "--prefill-tps", "200000") as eng:
        yield eng


@contextmanager
def two_gateways(engine, tmp_path, tenant: str, store_url: str):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"state_store: {store_url}\ntenants:\n  - {tenant}\n")
    with ExitStack() as stack:
        gws = [
            stack.enter_context(
                gateway_process("serve", "--config", str(cfg), "--endpoint", f"e1={engine.url}={MODEL}")
            )
            for _ in range(2)
        ]
        yield gws


async def _client(port: int, until: float, out: list) -> None:
    """Requests one after another; after a 429, 20 ms before the next (over the limit)."""
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            r = await http_request(port, "POST", "/v1/completions", BODY, HEADERS, timeout=5.0)
        except (OSError, asyncio.TimeoutError):
            out.append((t0, port, 0, time.monotonic() - t0, 0))
            continue
        tokens = r.json()["usage"]["total_tokens"] if r.status == 200 else 0
        out.append((t0, port, r.status, time.monotonic() - t0, tokens))
        if r.status != 200:
            await asyncio.sleep(0.02)


async def _load(gws, seconds: float, clients: int = 4) -> list:
    out: list = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(_client(g.port, until, out) for g in gws for _ in range(clients)))
    return out


def _window(recs, start: float, end: float) -> list:
    return [r for r in recs if start <= r[0] < end]


def _admitted(recs) -> int:
    return sum(r[2] == 200 for r in recs)


def _level(rs, kind: str) -> float:
    """The shared bucket's level, read from Redis (a missing key is a full bucket)."""
    raw = rs.command("HGET", f"velocity:tenant:t:{kind}", "level")
    return float("inf") if raw.startswith(b"$-1") else float(raw.split(b"\r\n")[1])


async def _store_metrics(g) -> dict[str, float]:
    """A replica's ``velocity_state_store_*`` samples from its /metrics, by name."""
    text = (await http_request(g.admin_port, "GET", "/metrics")).body.decode()
    return {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("velocity_state_store_")}


async def _store_answers(gws, timeout: float = 20.0) -> None:
    """Until every replica says the store answers again (``velocity_state_store_up 1``),
    requests flowing meanwhile: a replica that has not yet reconnected still applies the
    limit alone, and a figure measured then is twice the shared one. Waits on that event,
    not on a time (the reconnect backs off up to 1 s, longer on a loaded machine)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if all([(await _store_metrics(g)).get("velocity_state_store_up") == 1 for g in gws]):
            return
        await _load(gws, 0.2, clients=1)
    raise AssertionError("a replica never said the store answers again")


async def _store_errors(gws) -> float:
    """State store calls that failed, summed over the replicas
    (``velocity_state_store_errors_total``)."""
    return sum([(await _store_metrics(g)).get("velocity_state_store_errors_total", 0.0) for g in gws])


async def _shared_window(gws, rs, kind: str, cap: float, seconds: float, tries: int = 3):
    """A load window the shared bucket served throughout: (records, seconds it took, the
    level it started from). A store call that fails (a round trip past its timeout, as on
    a machine loaded past its cores) sends that replica to its local bucket, which admits
    the limit again on its own: such a window measures the fallback, not the shared
    bucket, and is measured again after the bucket is drained anew (at most ``tries``)."""
    for _ in range(tries):
        await _store_answers(gws)
        await _drain(gws, rs, kind, cap)
        errors = await _store_errors(gws)
        left = _level(rs, kind)
        t0 = time.monotonic()
        recs = await _load(gws, seconds)
        took = time.monotonic() - t0
        if await _store_errors(gws) == errors:
            return recs, took, left
        print(f"a store call failed during the {seconds:.0f} s window: measured again")
    raise AssertionError(f"a store call failed during each of {tries} windows")


async def _drain(gws, rs, kind: str, cap: float, timeout: float = 15.0) -> None:
    """Load until the shared bucket is (nearly) empty and both replicas turn requests away,
    in a round that began with it (nearly) empty too. A replica's lease is sized by the
    level its last answer gave (an eighth of it, after a burst), so a replica whose view
    was still of a full bucket takes a lease far past what is left (under two CPU hogs, one
    window served 164 tokens more than its start level and refill). After a round that
    began low, every view is low, and a replica that turned a request away in it has spent
    the lease it took on an older one."""
    until = time.monotonic() + timeout
    low = False
    while time.monotonic() < until:
        recs = await _load(gws, 0.5)
        was_low, low = low, _level(rs, kind) < 0.05 * cap
        if was_low and low and all(any(r[1] == g.port and r[2] == 429 for r in recs) for g in gws):
            return
    raise AssertionError("the tenant's bucket never emptied")


@pytest.mark.timed  # a rate over a window
async def test_two_replicas_admit_the_tenant_rate_once(engine, tmp_path):
    rate = 40
    with (
        redis_server() as rs,
        two_gateways(engine, tmp_path, f"{{name: t, requests_per_second: {rate}, burst: 10}}", rs.url) as gws,
    ):
        recs, _, _ = await _shared_window(gws, rs, "requests", 10, 6.0)
        t0 = min(r[0] for r in recs)
        got = _admitted(_window(recs, t0, t0 + 6.0)) / 6.0
        print(f"two replicas, limit {rate}/s: admitted {got:.2f}/s")
        assert abs(got - rate) <= 0.05 * rate, f"admitted {got:.1f}/s across two replicas, limit {rate}/s"
        for g in gws:  # both replicas carried load over the limit
            mine = [r for r in recs if r[1] == g.port]
            assert _admitted(mine) > 0 and any(r[2] == 429 for r in mine)
            assert all(r[2] in (200, 429) for r in mine)


@pytest.mark.timed  # rates over windows, a latency bound
async def test_a_stopped_store_leaves_requests_to_the_local_limit_and_never_waited_on(engine, tmp_path):
    rate = 40
    with (
        redis_server() as rs,
        two_gateways(engine, tmp_path, f"{{name: t, requests_per_second: {rate}, burst: 10}}", rs.url) as gws,
    ):
        recs, took, _ = await _shared_window(gws, rs, "requests", 10, 3.0)
        shared = _admitted(recs) / took
        assert abs(shared - rate) <= 0.1 * rate, shared
        rs.pause()  # stopped: accepts connections, answers nothing
        try:
            t1 = time.monotonic()
            down = await _load(gws, 3.0)
            elapsed = time.monotonic() - t1
            for g in gws:  # what a dashboard shows meanwhile: the store down, its failed calls counted
                metrics = await _store_metrics(g)
                assert metrics.get("velocity_state_store_up") == 0, metrics
                assert metrics.get("velocity_state_store_errors_total", 0) >= 1, metrics
        finally:
            rs.resume()
        got = _admitted(down) / elapsed
        print(f"store paused: admitted {got:.2f}/s, slowest {max(r[3] for r in down) * 1000:.0f} ms")
        # Each replica alone applies the limit: more than the shared rate, at most twice it
        # (and the burst each local bucket may hold).
        assert rate * 1.2 <= got <= (2 * rate * elapsed + 2 * 10 + 4) / elapsed, got
        lat = sorted(r[3] for r in down)
        assert all(r[2] in (200, 429) for r in down)
        # Not one request waited on the store: a wait would last its 250 ms timeout.
        assert lat[-1] < 0.2, f"slowest {lat[-1] * 1000:.0f} ms while the store was stopped"
        # Back: every replica says the store answers again before the window (_store_answers).
        recs, took, _ = await _shared_window(gws, rs, "requests", 10, 3.0)
        back = _admitted(recs) / took
        print(f"limit {rate}/s: shared {shared:.2f}/s, after the store returned {back:.2f}/s")
        assert abs(back - rate) <= 0.1 * rate, f"after the store returned: {back:.1f}/s, limit {rate}/s"


@pytest.mark.timed  # rates over windows, a latency bound
async def test_tokens_per_minute_hold_across_replicas_and_through_a_store_restart(engine, tmp_path):
    tpm = 6000  # 100 tokens a second; a request here costs about 15 (prompt and 8 completed)
    per_s = tpm / 60
    with redis_server() as rs, two_gateways(engine, tmp_path, f"{{name: t, tokens_per_minute: {tpm}}}", rs.url) as gws:
        # What the drain left in the shared bucket (negative: a debt of settlements) is
        # served on top of the quota's refill. Beside it, a constant of a few requests is
        # served that no window sees charged: the replicas' leases (100 ms of the rate
        # each) and settlements still on their way. 10 s keeps that within a few percent;
        # over 6 s, one CI run under a CPU hog read 110.5 tokens/s against 100.
        recs, _, left = await _shared_window(gws, rs, "tokens", tpm, 10.0)
        t0 = min(r[0] for r in recs)
        tokens = sum(r[4] for r in _window(recs, t0, t0 + 10.0)) / 10.0
        due = per_s + left / 10.0
        print(f"two replicas, quota {per_s} tokens/s and {left:.0f} left in the bucket: served {tokens:.2f}/s")
        assert abs(tokens - due) <= 0.1 * per_s, (
            f"{tokens:.1f} tokens/s across two replicas, quota {per_s}/s and {left:.0f} left: {due:.1f}/s due"
        )
        rs.stop()  # gone: connections refused
        try:
            t1 = time.monotonic()
            down = await _load(gws, 3.0)
            elapsed = time.monotonic() - t1
        finally:
            rs.start()  # back on the same port, empty (no persistence): every bucket full
        assert _admitted(down) > 0
        assert max(r[3] for r in down) < 0.2
        assert sum(r[4] for r in down) / elapsed <= 2 * per_s + (2 * 2 * 30) / elapsed
        # The fresh store's full bucket, less what the outage was charged, drained first.
        back, took, left = await _shared_window(gws, rs, "tokens", tpm, 4.0)
        got, due = sum(r[4] for r in back) / took, per_s + left / took
        print(
            f"store restarted: down {sum(r[4] for r in down) / elapsed:.2f} tokens/s, "
            f"slowest {max(r[3] for r in down) * 1000:.0f} ms; after {got:.2f} tokens/s ({left:.0f} left)"
        )
        assert abs(got - due) <= 0.15 * per_s, (
            f"after the store returned: {got:.1f} tokens/s, quota {per_s}/s and {left:.0f} left: {due:.1f}/s due"
        )


def test_a_bad_state_store_is_refused_at_start_naming_the_key(engine, tmp_path):
    gp = GatewayProcess(
        "serve", "--endpoint", f"e1={engine.url}={MODEL}", "--state-store", "redis://127.0.0.1:notaport/0"
    )
    try:
        gp.spawn()
        assert gp.wait(20) != 0
        assert "state_store" in gp.stderr_text + gp.stdout_text
    finally:
        gp.close()


async def _burst(port: int, n: int) -> list[int]:
    """``n`` requests at once: their statuses."""
    rs = await asyncio.gather(
        *(http_request(port, "POST", "/v1/completions", BODY, HEADERS, timeout=10.0) for _ in range(n))
    )
    return [r.status for r in rs]


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_concurrent_burst_is_admitted_up_to_burst_with_a_store(engine, tmp_path, workers):
    """``requests_per_second: 4, burst: 4`` and 12 requests at once, three times, 2 s apart
    (the bucket full again): never more than the bucket grants, 4 and what refills while
    the burst is on (4 a second: 4 for a burst that takes under 250 ms), with one
    worker and with two (each takes a lease of its own). Before, a lease held while the
    bucket refilled was granted again and a replica drew on a stale view of the level:
    5/4/4 here with two workers and 3/3/3 with one (6/6/6 and 6/5/5 where first seen). One worker, alone at the store, admits 4
    as it does without one; two admit at least one each time (a burst that lands on one
    worker gets its lease and the refills that come back while it lasts)."""
    cfg = tmp_path / "gw.yaml"
    with redis_server() as rs:
        cfg.write_text(
            f"state_store: {rs.url}\nworkers: {workers}\ntenants:\n  - {{name: t, requests_per_second: 4, burst: 4}}\n"
        )
        with gateway_process("serve", "--config", str(cfg), "--endpoint", f"e1={engine.url}={MODEL}") as g:
            await _store_answers([g])
            await asyncio.sleep(1.5)  # the bucket full again after the check's requests
            got = []
            for _ in range(3):
                t0 = time.monotonic()
                statuses = await _burst(g.port, 12)
                took = time.monotonic() - t0
                assert set(statuses) <= {200, 429}, statuses
                got.append((statuses.count(200), took))
                await asyncio.sleep(2.0)
            print(f"workers {workers}: admitted {[n for n, _ in got]} of 12 at once, limit 4")
            for n, took in got:
                # A draw takes a whole request: what the bucket held (4) and refilled meanwhile.
                assert (4 if workers == 1 else 1) <= n <= int(4 + 4 * took), got
