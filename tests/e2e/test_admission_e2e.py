"""Admission end to end: real sockets on 127.0.0.1, a gateway in
front of sim engines or of a tiny fake engine that the test controls.

What a client sees: an SLA no engine can meet is declined at once with 429 `sla` when
the request would have to queue, and served when it can go at once; a full band queue answers 503
`capacity`; a request that waits past its band's TTL 504 `ttl`; a client that leaves
while queued leaves the queue at once and never reaches an engine; an engine that runs
out of memory drops to the minimum limit while non-high work is shed (503 `overload`)
for the cool-down, high work keeps being served, and both recover after it; a scrape
that hangs, or one engine that reports a deep queue, does not stop the pool; a burst
on an idle pool never puts more on an engine than its limit; and `velocityllm serve`
refuses bands whose ceilings rise as priority falls.

The fake engine is used where the test must know exactly what an engine received or
must script its answers (out of memory once, metrics that never come).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.support.gateway import GatewayProcess, ScriptedServer, real_client, running_gateway, wait_until
from tests.support.sim import http_request, sim_engine, start_sim_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

MODEL = "sim-model"
CHAT = "/v1/chat/completions"
IDLE_METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.0\n"
# vLLM's shape of an engine error, with the text PyTorch raises.
OOM_BODY = json.dumps(
    {
        "object": "error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB.",
    }
).encode()


def chat(content: str = "hello", max_tokens: int = 16, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def bands(**overrides: dict) -> list[dict]:
    """The default bands, with some keys of some bands changed."""
    out = [{"name": "high", "ceiling": 1.5}, {"name": "normal", "ceiling": 1.0}, {"name": "low", "ceiling": 0.8}]
    for b in out:
        b.update(overrides.get(b["name"], {}))
    return out


async def post(gw, body: dict, timeout: float = 20.0, **headers: str):
    return await http_request(
        gw.port, "POST", CHAT, body, {k.replace("_", "-"): v for k, v in headers.items()}, timeout=timeout
    )


async def admin_stats(gw) -> dict:
    """The admin port's /stats, over HTTP as an operator reads it."""
    r = await http_request(gw.admin_port, "GET", "/stats", timeout=5.0)
    assert r.status == 200, r.body
    return r.json()


def depth(stats: dict, band: str) -> int:
    return stats["admission"]["bands"][band]["depth"]


class FakeEngine(ScriptedServer):
    """A tiny engine on 127.0.0.1 whose answers the test scripts.

    ``/health`` 200. ``/metrics`` answers ``metrics`` (None: never answers, the
    connection hangs until the engine stops). Any POST is recorded in ``bodies`` and
    answered with a chat completion after ``delay`` seconds and once ``gate`` (when
    set) is open, or with vLLM's 500 `CUDA out of memory` while ``oom_left`` > 0.
    ``active``/``peak``: requests being answered now / the most at once.
    """

    def __init__(self, metrics: bytes | None = IDLE_METRICS, delay: float = 0.0) -> None:
        super().__init__()
        self.metrics = metrics
        self.delay = delay
        self.gate: asyncio.Event | None = None
        self.oom_left = 0
        self.bodies: list[dict] = []
        self.active = 0
        self.peak = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, path, _, body = await self.read_request(reader)
            if path == "/health":
                status, out = 200, b""
            elif path == "/v1/models":  # the gateway's monitor asks once (the context length)
                status, out = 200, b'{"object": "list", "data": []}'
            elif path == "/metrics":
                if self.metrics is None:
                    await asyncio.Event().wait()  # a scrape that never gets an answer
                status, out = 200, self.metrics
            else:
                status, out = await self._complete(json.loads(body))
            reason = {200: "OK", 500: "Internal Server Error"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(out)}\r\n\r\n".encode()
                + out
            )
            await writer.drain()

    async def _complete(self, obj: dict) -> tuple[int, bytes]:
        self.bodies.append(obj)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.oom_left > 0:
                self.oom_left -= 1
                return 500, OOM_BODY
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.gate is not None:
                await self.gate.wait()
            n = len(self.bodies)
            return 200, json.dumps(
                {
                    "id": f"chatcmpl-{n}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": MODEL,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}
                    ],
                    # The tokens asked for, or 16 when none were named: the gateway learns a reply's
                    # time per token from usage, so a fake that says 1 token takes 50 ms for it.
                    "usage": {
                        "prompt_tokens": 3,
                        "completion_tokens": obj.get("max_tokens") or 16,
                        "total_tokens": 3 + (obj.get("max_tokens") or 16),
                    },
                }
            ).encode()
        finally:
            self.active -= 1


async def stop_tasks(*tasks: asyncio.Task, wait: float = 0.0) -> None:
    """Cancel ``tasks`` (after ``wait`` seconds) and wait for them to end."""
    await asyncio.sleep(wait)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def raw_request(port: int, body: dict, **headers: str):
    """Send one request on a new connection without reading the answer; abort() it to leave."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer


# -- SLA-aware 429 ---------------------------------------------------------------------------


@pytest.fixture
def sim():
    # 10x real time at 50 tokens/s: a 200-token answer takes about 0.4 s.
    eng = start_sim_engine("--max-num-seqs", "8", model=MODEL, time_scale=10)
    yield eng
    eng.stop()


@pytest.mark.timed  # a 429 timed against a quarter of the service time
async def test_sla_far_below_service_time_is_429_at_once_when_it_would_queue_never_when_idle(sim):
    async with running_gateway(sim, policy="dynamic", max_concurrency=1) as gw:
        for _ in range(2):  # what this engine takes per token, learned by admission
            assert (await post(gw, chat(max_tokens=200))).status == 200
        tight = chat("status?", max_tokens=200)

        t0 = time.monotonic()
        idle = await post(gw, tight, x_velocity_sla_ms="20")
        service_s = time.monotonic() - t0
        assert idle.status == 200, idle.body  # idle: never declined on a prediction
        assert service_s > 0.2  # the SLA really is far below what the engine takes

        background = asyncio.create_task(post(gw, chat("a long essay", max_tokens=3000), timeout=30))
        patient = None
        try:
            await wait_until(lambda: gw.endpoints["e1"].inflight == 1, 5.0, what="a request in flight")
            rejected = []
            for band in ("normal", "high"):
                t0 = time.monotonic()
                r = await post(gw, tight, x_velocity_sla_ms="20", x_velocity_priority=band)
                rejected.append((r, time.monotonic() - t0))
            # The same request with an SLA it can meet queues instead: the 429 is the prediction's.
            patient = asyncio.create_task(post(gw, tight, x_velocity_sla_ms="600000", timeout=30))
            await wait_until(lambda: gw.admission.stats()["queued"] == 1, 5.0, what="the patient one queued")
        finally:
            await stop_tasks(background)
        assert (await patient).status == 200
        for r, took in rejected:
            assert r.status == 429, r.body
            assert r.headers.get("x-velocity-reject-reason") == "sla"
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == 429
            assert took < service_s / 4, f"the 429 took {took * 1000:.0f} ms, service {service_s * 1000:.0f} ms"

        await wait_until(lambda: gw.endpoints["e1"].inflight == 0, 5.0, what="the engine idle again")
        again = await post(gw, tight, x_velocity_sla_ms="20")
        assert again.status == 200, again.body
        stats = await admin_stats(gw)
        assert stats["admission"]["rejections"].get("sla") == 2


# -- bounded queues: capacity and TTL ----------------------------------------------------------


@pytest.fixture
def slow_sim():
    # Real time, 50 tokens/s: a 2000-token answer holds the only slot for 40 s.
    eng = start_sim_engine(model=MODEL, time_scale=1)
    yield eng
    eng.stop()


async def test_full_band_queue_is_503_capacity(slow_sim):
    async with running_gateway(
        slow_sim, policy="dynamic", max_concurrency=1, bands=bands(low={"queue_capacity": 2})
    ) as gw:
        holder = asyncio.create_task(post(gw, chat(max_tokens=2000), timeout=30))
        queued = []
        try:
            await wait_until(lambda: gw.endpoints["e1"].inflight == 1, 5.0, what="the slot taken")
            queued = [asyncio.create_task(post(gw, chat(), timeout=30, x_velocity_priority="low")) for _ in range(2)]
            await wait_until(
                lambda: gw.admission.stats()["bands"]["low"]["depth"] == 2, 5.0, what="two low requests queued"
            )
            t0 = time.monotonic()
            full = await post(gw, chat(), x_velocity_priority="low")
            took = time.monotonic() - t0
            # Another band's queue is its own: a normal request still queues.
            other = asyncio.create_task(post(gw, chat(), timeout=30))
            queued.append(other)
            await wait_until(
                lambda: gw.admission.stats()["bands"]["normal"]["depth"] == 1, 5.0, what="the normal request queued"
            )
            stats = await admin_stats(gw)
        finally:
            await stop_tasks(holder, *queued)
        assert full.status == 503, full.body
        assert full.headers.get("x-velocity-reject-reason") == "capacity"
        assert int(full.headers["retry-after"]) >= 1
        assert took < 1.0
        assert depth(stats, "low") == 2 and depth(stats, "normal") == 1
        assert stats["admission"]["rejections"].get("capacity") == 1


async def test_request_waiting_past_its_ttl_is_504(slow_sim):
    async with running_gateway(
        slow_sim, policy="dynamic", max_concurrency=1, bands=bands(normal={"ttl_ms": 300})
    ) as gw:
        holder = asyncio.create_task(post(gw, chat(max_tokens=2000), timeout=30, x_velocity_priority="high"))
        try:
            await wait_until(lambda: gw.endpoints["e1"].inflight == 1, 5.0, what="the slot taken")
            t0 = time.monotonic()
            r = await post(gw, chat())
            waited = time.monotonic() - t0
            stats = await admin_stats(gw)
        finally:
            await stop_tasks(holder)
        assert r.status == 504, r.body
        assert r.headers.get("x-velocity-reject-reason") == "ttl"
        assert 0.3 <= waited < 3.0
        assert depth(stats, "normal") == 0
        assert stats["admission"]["rejections"].get("ttl") == 1


# -- cancellation ------------------------------------------------------------------------------


async def test_cancelled_queued_request_leaves_the_queue_at_once_and_never_reaches_the_engine():
    async with FakeEngine() as eng:
        eng.gate = asyncio.Event()
        async with running_gateway(("e1", eng.url, MODEL), policy="dynamic", max_concurrency=1) as gw:
            holder = asyncio.create_task(post(gw, chat("holder"), timeout=30))
            writer = None
            try:
                await wait_until(lambda: len(eng.bodies) == 1, 5.0, what="the holder at the engine")
                _, writer = await raw_request(gw.port, chat("leaves while queued"))
                await wait_until(
                    lambda: gw.admission.stats()["bands"]["normal"]["depth"] == 1, 5.0, what="the second request queued"
                )
                before = await admin_stats(gw)
                t0 = time.monotonic()
                writer.transport.abort()
                while depth(await admin_stats(gw), "normal") != 0:
                    assert time.monotonic() - t0 < 1.0, "the cancelled request is still queued"
                left_after = time.monotonic() - t0
                eng.gate.set()  # the slot frees: nothing queued may take it
                assert (await holder).status == 200
                after_holder = await post(gw, chat("after"))
                stats = await admin_stats(gw)
            finally:
                eng.gate.set()
                if writer is not None:
                    writer.transport.abort()
                await stop_tasks(holder)
        assert depth(before, "normal") == 1
        assert left_after < 1.0
        assert after_holder.status == 200
        contents = [b["messages"][0]["content"] for b in eng.bodies]
        assert contents == ["holder", "after"], contents
        assert stats["admission"]["queue_cancelled"] == 1


# -- out of memory ---------------------------------------------------------------------------


async def test_oom_drops_the_limit_sheds_non_high_for_the_cooldown_keeps_high_and_recovers():
    async with FakeEngine(delay=0.05) as eng:
        async with running_gateway(
            ("e1", eng.url, MODEL),
            policy="dynamic",
            max_concurrency=8,
            admission={"oom_cooldown_ms": 1500.0, "aimd_min": 1},
        ) as gw:
            assert (await admin_stats(gw))["admission"]["limits"]["e1"] == 8
            eng.oom_left = 1
            failed = await post(gw, chat("first"))
            t_oom = time.monotonic()
            assert failed.status == 500 and b"out of memory" in failed.body  # the engine's error, relayed

            during = await admin_stats(gw)
            shed = {band: await post(gw, chat(band), x_velocity_priority=band) for band in ("normal", "low")}
            high = [await post(gw, chat("high"), x_velocity_priority="high") for _ in range(3)]
            in_cooldown = time.monotonic() - t_oom < 1.5
            served_during = len(eng.bodies)

            # After the cool-down: non-high work is served again and the limit climbs back
            # while work queues behind it.
            await asyncio.sleep(max(0.0, t_oom + 1.7 - time.monotonic()))
            burst = await asyncio.gather(*(post(gw, chat(f"after {i}")) for i in range(12)))
            after = await admin_stats(gw)

        assert during["admission"]["limits"]["e1"] == 1
        assert during["admission"]["pools"][MODEL]["overload_s"] > 0
        assert in_cooldown, "the checks ran past the cool-down: too slow to judge"
        for band, r in shed.items():
            assert r.status == 503, (band, r.status, r.body)
            assert r.headers.get("x-velocity-reject-reason") == "overload"
            assert int(r.headers["retry-after"]) >= 1
        assert [r.status for r in high] == [200, 200, 200]
        assert served_during == 4  # the failed one and the three high ones: no shed request got through
        assert [r.status for r in burst] == [200] * 12
        assert after["admission"]["pools"][MODEL]["overload_s"] == 0
        assert after["admission"]["limits"]["e1"] > 1
        assert after["admission"]["rejections"].get("overload") == 2


# -- engine metrics: missing, stale, hot -----------------------------------------------------


async def test_a_metrics_scrape_that_hangs_does_not_halt_dispatch():
    async with FakeEngine(metrics=None, delay=0.02) as eng:
        async with running_gateway(
            ("e1", eng.url, MODEL),
            policy="dynamic",
            max_concurrency=2,
            health={
                "scrape_interval_ms": 50.0,
                "scrape_timeout_ms": 200.0,
                "check_interval_ms": 100.0,
                "check_timeout_ms": 500.0,
            },
            bands=bands(normal={"ttl_ms": 5000}, low={"ttl_ms": 5000}),
        ) as gw:
            await asyncio.sleep(0.5)  # several scrapes abandoned
            t0 = time.monotonic()
            rs = await asyncio.gather(
                *(post(gw, chat(f"q{i}"), x_velocity_priority=("normal", "low")[i % 2]) for i in range(20))
            )
            took = time.monotonic() - t0
            stats = await admin_stats(gw)
        assert [r.status for r in rs] == [200] * 20, [(r.status, r.headers.get("x-velocity-reject-reason")) for r in rs]
        assert len(eng.bodies) == 20 and eng.peak <= 2
        # 10 rounds of 20 ms on two slots; a halted queue would wait out the 5 s TTL.
        assert took < 4.0
        ep = stats["endpoints"][0]
        assert ep["healthy"] and ep["metrics_age_s"] is None  # never scraped, still serving


async def test_one_hot_engine_does_not_hold_back_a_pool_whose_other_engine_has_room(sim):
    hot_metrics = b"vllm:num_requests_running 8\nvllm:num_requests_waiting 50\nvllm:kv_cache_usage_perc 0.99\n"
    async with FakeEngine(metrics=hot_metrics) as hot:
        async with running_gateway(
            ("hot", hot.url, MODEL),
            ("cool", sim.url, MODEL),
            policy="dynamic",
            max_concurrency=8,
            bands=bands(normal={"ttl_ms": 3000}, low={"ttl_ms": 3000}),
        ) as gw:
            await wait_until(lambda: all(e.scraped_at for e in gw.endpoints.values()), 5.0, what="both engines scraped")
            pool_sat = (await admin_stats(gw))["admission"]["pools"][MODEL]["saturation"]
            rs = await asyncio.gather(
                *(
                    post(gw, real_client(chat(f"q{i}", max_tokens=20), i), x_velocity_priority=("normal", "low")[i % 2])
                    for i in range(16)
                )
            )
        assert pool_sat < 0.8, pool_sat  # the pool is as free as its freest engine
        assert [r.status for r in rs] == [200] * 16, [(r.status, r.headers.get("x-velocity-reject-reason")) for r in rs]
        assert {r.headers["x-velocity-endpoint"] for r in rs} == {"cool"}
        assert hot.bodies == []


# -- a burst on an idle pool -----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["static", "dynamic", "smart"])
async def test_a_burst_on_an_idle_pool_never_exceeds_the_engines_limits(policy):
    async with FakeEngine(delay=0.05) as a, FakeEngine(delay=0.05) as b:
        async with running_gateway(("a", a.url, MODEL), ("b", b.url, MODEL), policy=policy, max_concurrency=4) as gw:
            peak_queue = 0

            async def watch_queue():
                nonlocal peak_queue
                while True:
                    peak_queue = max(peak_queue, gw.admission.stats()["queued"])
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch_queue())
            try:
                # As ordinary clients write them: some without max_tokens, with vLLM's
                # priority 0 (its default: the default band, not high), temperature and stop.
                rs = await asyncio.gather(*(post(gw, real_client(chat(f"b{i}"), i), timeout=30) for i in range(200)))
            finally:
                await stop_tasks(watcher)
        assert [r.status for r in rs] == [200] * 200, [
            (i, r.status, r.headers.get("x-velocity-reject-reason"), r.body[:200])
            for i, r in enumerate(rs)
            if r.status != 200
        ]
        assert len(a.bodies) + len(b.bodies) == 200
        sent = {f"b{i}": real_client(chat(f"b{i}"), i) for i in range(200)}
        for got in a.bodies + b.bodies:  # byte for byte but the gateway's own field, priority
            want = dict(sent[got["messages"][0]["content"]])
            want.pop("priority", None)
            assert got == want, (got, want)
        assert a.peak <= 4 and b.peak <= 4, (a.peak, b.peak)
        # The burst really was far more than the pool's 8 slots could take at once. (The
        # engines drain 160 a second, so a client side slow to send all 200, as on a loaded
        # machine, builds a queue of fewer than 200 - 8; 50 still means a real burst.)
        assert peak_queue >= 50, peak_queue


# -- configuration ---------------------------------------------------------------------------


def test_serve_with_ceilings_rising_as_priority_falls_exits_2_with_a_clear_error(tmp_path):
    cfg = tmp_path / "velocity.yaml"
    cfg.write_text(
        "policy: dynamic\n"
        "endpoints:\n  - {name: e1, url: 'http://127.0.0.1:9', model: m}\n"
        "bands:\n"
        "  - {name: urgent, ceiling: 1.5}\n"
        "  - {name: standard, ceiling: 0.9}\n"
        "  - {name: bulk, ceiling: 0.95}\n"
    )
    gp = GatewayProcess("serve", "--config", str(cfg))
    try:
        gp.spawn()
        code = gp.wait(30)
        err = gp.stderr_text.strip()
    finally:
        gp.close()
    assert code == 2, err
    assert "Traceback" not in err
    line = err.splitlines()[-1]
    assert "bands[2].ceiling" in line and "'bulk'" in line and "'standard'" in line, line
    assert "must not rise" in line, line


# -- a flood's batch work on an engine that waits its turn to probe -------------------------


async def test_a_low_flood_leaves_the_waiting_engine_slots_for_high_work():
    """Two engines of 16 the gateway is not told about: the first probes for its batch,
    the second keeps its starting limit of 8, of which low may hold its soft ceiling's
    share (5) and high finds the rest. Low work is also bound one request at a time at
    each engine's turn (batch_next); a low request granted when no engine's turn had come
    went to any engine below its limit, past low's share, and filled the second engine's 8:
    high work then had only the probe's overshoot to wait behind (seconds, in front of
    real vLLM engines)."""
    flags = ("--max-num-seqs", "16", "--decode-tps", "50")
    with sim_engine(*flags, model=MODEL) as a, sim_engine(*flags, model=MODEL) as b:
        async with running_gateway(a, b, policy="dynamic") as gw:
            low = chat("summarize the whole history of the project in detail", max_tokens=600)

            async def client():
                while True:
                    r = await post(gw, low, timeout=60, x_velocity_priority="low")
                    if r.status != 200:
                        await asyncio.sleep(0.2)

            most = {"e1": 0, "e2": 0}

            async def watch():
                while True:
                    for name, e in gw.admission.stats()["endpoints"].items():
                        most[name] = max(most[name], e["inflight"])
                    await asyncio.sleep(0.005)

            lows = [asyncio.create_task(client()) for _ in range(64)]
            try:
                await stop_tasks(asyncio.create_task(watch()), wait=2.0)  # 600 tokens at 50 a second: none ends
                high = await post(gw, chat("is the gateway up?", max_tokens=8), x_velocity_priority="high")
            finally:
                await stop_tasks(*lows)
        assert high.status == 200
        # The probe's engine held more than the other's share: the flood was real.
        assert most["e1"] > 8, most
        assert most["e2"] <= 5, most
        assert high.headers["x-velocity-endpoint"] == "e2"
