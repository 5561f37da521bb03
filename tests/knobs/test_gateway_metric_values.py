"""Each documented metric that no other test read back: drive the situation it counts through
a running gateway and read the value from the admin port's /metrics (docs/operations.md,
"Metrics")."""

from __future__ import annotations

import asyncio

from tests.knobs.knob_support import GaugeEngine, admin_metric, completion
from tests.support.gateway import running_gateway, wait_until

# Health checks rare enough that an engine that goes away stays "healthy" for the test:
# the gateway finds out by connecting, as it would between two checks.
SLOW_CHECKS = {
    "scrape_interval_ms": 50.0,
    "check_interval_ms": 60000.0,
    "check_timeout_ms": 500.0,
    "eject_base_ms": 60000.0,
    "eject_max_ms": 60000.0,
}


async def _scraped(gw, name: str, **values) -> None:
    ep = gw.endpoints[name]
    await wait_until(
        lambda: all(getattr(ep, k) == v for k, v in values.items()), 5.0, what=f"a scrape of {name} showing {values}"
    )


async def test_engine_gauges_follow_the_engines_metrics():
    async with GaugeEngine(running=7, waiting=3, kv=0.42) as a, GaugeEngine(running=1, kv=0.05) as b:
        async with running_gateway(("a", a.url, "m1"), ("b", b.url, "m1"), policy="static") as gw:
            await _scraped(gw, "a", running=7, waiting=3, kv_usage=0.42)
            await _scraped(gw, "b", running=1, waiting=0, kv_usage=0.05)
            port = gw.admin_port
            assert await admin_metric(port, "velocity_endpoint_engine_running", endpoint="a", model="m1") == 7
            assert await admin_metric(port, "velocity_endpoint_engine_waiting", endpoint="a", model="m1") == 3
            assert await admin_metric(port, "velocity_endpoint_kv_usage", endpoint="a", model="m1") == 0.42
            assert await admin_metric(port, "velocity_endpoint_engine_running", endpoint="b") == 1
            assert await admin_metric(port, "velocity_endpoint_kv_usage", endpoint="b") == 0.05
            # The next scrapes carry new values through.
            a.running, a.waiting, a.kv = 2, 0, 0.9
            await _scraped(gw, "a", running=2, waiting=0, kv_usage=0.9)
            assert await admin_metric(port, "velocity_endpoint_engine_running", endpoint="a") == 2
            assert await admin_metric(port, "velocity_endpoint_engine_waiting", endpoint="a") == 0
            assert await admin_metric(port, "velocity_endpoint_kv_usage", endpoint="a") == 0.9


async def test_endpoint_inflight_counts_requests_held_by_the_engine():
    async with GaugeEngine() as eng:
        async with running_gateway(("a", eng.url, "m1"), policy="static", max_concurrency=8) as gw:
            assert await admin_metric(gw.admin_port, "velocity_endpoint_inflight", endpoint="a") == 0
            eng.hold = True
            tasks = [asyncio.create_task(completion(gw.port)) for _ in range(3)]
            try:
                await wait_until(lambda: eng.holding == 3, 5.0, what="3 requests held by the engine")
                assert await admin_metric(gw.admin_port, "velocity_endpoint_inflight", endpoint="a") == 3
            finally:
                eng.release()
                results = await asyncio.gather(*tasks)
            assert [r.status for r in results] == [200] * 3
            assert await admin_metric(gw.admin_port, "velocity_endpoint_inflight", endpoint="a") == 0


async def test_upstream_errors_count_resets_and_connect_failures_by_endpoint():
    async with GaugeEngine() as good:
        bad = GaugeEngine()
        await bad.__aenter__()
        try:
            async with running_gateway(
                ("bad", bad.url, "m1"), ("good", good.url, "m1"), policy="static", health=SLOW_CHECKS
            ) as gw:
                port = gw.admin_port
                assert not await admin_metric(port, "velocity_upstream_errors_total")
                # An engine that drops the connection once it read the request: kind reset.
                # Requests go to both (shortest queue, ties at random) until one met bad.
                bad.reset = True
                for _ in range(20):
                    assert (await completion(gw.port)).status == 200  # retried on good
                    if await admin_metric(port, "velocity_upstream_errors_total"):
                        break
                resets = await admin_metric(port, "velocity_upstream_errors_total", endpoint="bad", kind="reset")
                assert resets == 1
                assert not await admin_metric(port, "velocity_upstream_errors_total", endpoint="good")
        finally:
            await bad.__aexit__(None, None, None)

    # The engine's port closed while the gateway still counts it healthy: kind connect.
    gone = GaugeEngine()
    await gone.__aenter__()
    try:
        async with running_gateway(("gone", gone.url, "m1"), policy="static", health=SLOW_CHECKS) as gw:
            assert (await completion(gw.port)).status == 200
            await gone.__aexit__(None, None, None)
            r = await completion(gw.port)
            assert r.status == 502 and r.headers["x-velocity-reject-reason"] == "upstream"
            assert (
                await admin_metric(gw.admin_port, "velocity_upstream_errors_total", endpoint="gone", kind="connect")
                == 1
            )
            assert not await admin_metric(gw.admin_port, "velocity_upstream_errors_total", kind="reset")
    finally:
        await gone.__aexit__(None, None, None)


async def test_route_no_endpoint_counts_picks_that_found_none():
    gone = GaugeEngine()
    await gone.__aenter__()
    try:
        async with running_gateway(("gone", gone.url, "m1"), policy="static", health=SLOW_CHECKS) as gw:
            assert (await completion(gw.port)).status == 200
            assert await admin_metric(gw.admin_port, "velocity_route_no_endpoint_total") == 0
            await gone.__aexit__(None, None, None)
            # The only engine fails to connect: the retry's pick finds no other endpoint.
            assert (await completion(gw.port)).status == 502
            after = await admin_metric(gw.admin_port, "velocity_route_no_endpoint_total")
            assert after >= 1
    finally:
        await gone.__aexit__(None, None, None)


async def test_route_fail_open_counts_picks_among_all_saturated_engines():
    async with GaugeEngine(waiting=9) as a, GaugeEngine(waiting=1) as b:
        async with running_gateway(
            ("a", a.url, "m1"), ("b", b.url, "m1"), policy="static", routing={"saturation_waiting": 5}
        ) as gw:
            await _scraped(gw, "a", waiting=9)
            await _scraped(gw, "b", waiting=1)
            for _ in range(3):  # b is not saturated: picked, no fail-open
                r = await completion(gw.port)
                assert r.status == 200 and r.headers["x-velocity-endpoint"] == "b"
            assert await admin_metric(gw.admin_port, "velocity_route_fail_open_total") == 0
            b.waiting = 6  # now both are past 5 waiting
            await _scraped(gw, "b", waiting=6)
            for _ in range(4):
                r = await completion(gw.port)
                assert r.status == 200 and r.headers["x-velocity-endpoint"] == "b"  # the shorter queue
            assert await admin_metric(gw.admin_port, "velocity_route_fail_open_total") == 4


async def test_prefix_blocks_count_prompt_blocks_sent_and_held():
    async with GaugeEngine() as eng:
        async with running_gateway(("a", eng.url, "m1"), policy="smart") as gw:
            port = gw.admin_port
            prompt = "The quick brown fox jumps over the lazy dog. " * 15  # 675 bytes: 10 blocks of 64
            assert (await completion(gw.port, prompt=prompt)).status == 200
            assert await admin_metric(port, "velocity_prefix_blocks_total") == 10
            assert await admin_metric(port, "velocity_prefix_hit_blocks_total") == 0
            assert (await completion(gw.port, prompt=prompt)).status == 200
            assert await admin_metric(port, "velocity_prefix_blocks_total") == 20
            assert await admin_metric(port, "velocity_prefix_hit_blocks_total") == 10  # all held by a
            assert (await completion(gw.port, prompt="short")).status == 200  # under one block
            assert await admin_metric(port, "velocity_prefix_blocks_total") == 20
        # A larger block size makes fewer blocks of the same prompt.
        async with running_gateway(("a", eng.url, "m1"), policy="smart", routing={"block_bytes": 128}) as gw:
            assert (await completion(gw.port, prompt=prompt)).status == 200
            assert await admin_metric(gw.admin_port, "velocity_prefix_blocks_total") == 5
