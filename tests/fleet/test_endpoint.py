"""Endpoints and pools (compiled: fleet/endpoint.pyx) through their Python face."""

import time

import pytest

from velocity_fast.fleet.endpoint import Endpoint, Pool


def test_a_new_endpoint_is_unhealthy_unscraped_and_keeps_its_limit():
    ep = Endpoint("e1", "http://127.0.0.1:9000/", "m", api_key="k", limit=7)
    assert (ep.name, ep.url, ep.model, ep.api_key, ep.limit) == ("e1", "http://127.0.0.1:9000", "m", "k", 7)
    assert not ep.healthy and ep.state == "unknown" and ep.inflight == 0 and ep.upstream is None
    assert ep.metrics_age() == float("inf")
    snap = ep.snapshot()
    assert snap["metrics_age_s"] is None and snap["num_gpu_blocks"] is None and snap["limit"] == 7


def test_scraped_gauges_and_counts_read_back_as_written():
    ep = Endpoint("e1", "http://h", "m")
    ep.running, ep.waiting, ep.kv_usage = 6, 2, 0.5  # ints from a scrape read back as numbers
    ep.num_gpu_blocks, ep.block_size = 1024, 16
    ep.scraped_at = time.monotonic() - 2.0
    ep.inflight += 3
    assert (ep.running, ep.waiting, ep.kv_usage, ep.inflight) == (6.0, 2.0, 0.5, 3)
    assert 2.0 <= ep.metrics_age() < 10.0 and ep.metrics_age(ep.scraped_at + 1.0) == pytest.approx(1.0)
    assert ep.snapshot()["num_gpu_blocks"] == 1024


def test_a_wrong_type_is_refused_when_it_is_written_not_later_on_the_request_path():
    ep = Endpoint("e1", "http://h", "m")
    with pytest.raises(TypeError):
        ep.inflight = "3"
    with pytest.raises(TypeError):
        ep.scraped_at = None
    assert ep.inflight == 0 and ep.scraped_at == 0.0


def test_pool_lists_its_healthy_endpoints():
    a, b = Endpoint("a", "http://a", "m"), Endpoint("b", "http://b", "m")
    b.healthy = True
    pool = Pool("m", [a, b])
    assert pool.healthy() == [b] and Pool("m").endpoints == []
