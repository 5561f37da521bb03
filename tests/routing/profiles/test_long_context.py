"""The long-context profile (velocity_fast/routing/profiles/long_context.pyx): the most free KV cache."""

from tests.support.fleet import make_pool, scrape
from tests.support.fleet import make_router as router


def test_long_context_takes_the_most_free_kv():
    pool = make_pool(3)
    scrape(pool.endpoints[0], kv=0.6)
    scrape(pool.endpoints[1], kv=0.1, waiting=2)
    scrape(pool.endpoints[2], kv=0.4)
    r = router(default_profile="long-context")
    info = r.route_info("m", {"prompt": "x" * 4000}, {})
    assert {r.pick(pool, info).name for _ in range(50)} == {"e1"}


def test_long_context_counts_requests_sent_since_the_last_scrape():
    pool = make_pool(2)
    for ep in pool.endpoints:
        ep.num_gpu_blocks, ep.block_size = 1000, 16  # 1000 blocks of 16 tokens = 64000 bytes
    scrape(pool.endpoints[0], kv=0.10)
    scrape(pool.endpoints[1], kv=0.20)
    r = router(default_profile="long-context")
    info = r.route_info("m", {"prompt": "x" * 6400}, {})  # 100 blocks: 10% of an engine
    assert r.pick(pool, info) is pool.endpoints[0]
    pool.endpoints[0].inflight = 2  # sent since the scrape: about 20% more used
    assert r.pick(pool, info) is pool.endpoints[1]
