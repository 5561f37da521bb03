"""What an engine runs at once (Endpoint.running_cap), learned from its gauges by the
scraper: the hot-spot guard's estimate of the queue this gateway's requests make there."""
from __future__ import annotations

import asyncio

import pytest

from velocity_fast.fleet.endpoint import Endpoint
from velocity_fast.fleet.health import EndpointMonitor, HealthSettings

pytestmark = pytest.mark.timeout(30)


class _Upstream:
    def __init__(self) -> None:
        self.running = 0.0
        self.waiting = 0.0

    async def fetch(self, method, path, timeout=None):
        return 200, (f"vllm:num_requests_running{{engine=\"0\"}} {self.running}\n"
                     f"vllm:num_requests_waiting{{engine=\"0\"}} {self.waiting}\n"
                     "vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n").encode()


def test_running_cap_is_the_most_the_engine_ran_once_requests_waited():
    ep = Endpoint("e0", "http://127.0.0.1:9", "m")
    up = ep.upstream = _Upstream()
    mon = EndpointMonitor(HealthSettings(), lambda ep, state: None, lambda ep: None)

    def scrape(running, waiting):
        up.running, up.waiting = running, waiting
        asyncio.run(mon._scrape(ep))

    scrape(5, 0)
    assert ep.running_cap == 0          # never seen full: unknown, however much it runs
    scrape(12, 3)
    assert ep.running_cap == 12         # requests wait while it runs 12
    scrape(8, 0)
    assert ep.running_cap == 12         # running less, nobody waiting: still 12
    scrape(14, 0)
    assert ep.running_cap == 14         # it ran more than thought
    scrape(9, 2)
    assert ep.running_cap == 14         # a wait at fewer (the step's token budget): still 14
    assert (ep.running, ep.waiting) == (9, 2)
