"""The chat profile's own parts (velocity_fast/routing/profiles/chat.pyx): PrefixDemand, each
prefix's share of a pool's recent requests (the hot-spot guard's gate), and the engine
queues the guard reads. Its picks through the router (prefix affinity, sessions, the
guard) are tested in tests/routing/test_router.py and tests/routing/test_session_affinity.py."""

from __future__ import annotations

import time

import pytest

from tests.support.fleet import make_pool
from velocity_fast.routing.prefix import BlockHashes
from velocity_fast.routing.profiles.chat import DEMAND_DEPTH, DEMAND_KEYS, PrefixDemand, engine_queues

pytestmark = pytest.mark.timeout(30)


def chain(tag: int, n: int = 40) -> BlockHashes:
    return BlockHashes.of([tag * 1000 + i + 1 for i in range(n)])


def test_share_is_the_prefix_part_of_recent_requests_keyed_at_the_demand_depth():
    d = PrefixDemand()
    for i in range(30):
        d.share(chain(1 + i % 3))  # three prefixes, a third each
    assert d.share(chain(1)) == pytest.approx(11 / 31, rel=1e-3)
    # the same first DEMAND_DEPTH blocks, another tail: the same prefix
    tail = BlockHashes.of(chain(1).tolist()[:DEMAND_DEPTH] + [99, 98, 97])
    assert d.share(tail) == pytest.approx(12 / 32, rel=1e-3)
    # a short prompt is keyed by its last block
    assert d.share(BlockHashes.of([5, 6])) == pytest.approx(1 / 33, rel=1e-3)
    assert d.share(BlockHashes.of([])) == 0.0


def test_the_table_stays_bounded_under_ever_new_prefixes():
    d = PrefixDemand()
    for i in range(3 * DEMAND_KEYS):
        d.share(chain(i, 2))
    hot = chain(10**9, 2)
    for _ in range(50):
        d.share(hot)
    assert len(d) <= DEMAND_KEYS
    assert d.share(hot) > 50 / (3 * DEMAND_KEYS + 51) * 0.99


def scrape(ep, *, waiting=0.0, at=None):
    ep.waiting = float(waiting)
    ep.scraped_at = time.monotonic() if at is None else at


def test_an_engine_seen_full_is_hot_by_what_this_gateway_sent_beyond_it():
    e = make_pool(4).endpoints
    for ep in e[:3]:
        scrape(ep)
    e[0].inflight = 20  # never seen full: its own queue (0) alone
    e[1].running_cap, e[1].inflight = 12.0, 15  # 3 sent beyond what it runs at once
    e[2].running_cap, e[2].inflight = 12.0, 10  # room left: its gauge (0)
    scrape(e[3], at=time.monotonic() - 60)  # stale gauges: the gap decides
    assert engine_queues(e, 2.0) == [0.0, 3.0, 0.0, -1.0]
    scrape(e[0], waiting=4)
    assert engine_queues(e, 2.0)[0] == 4.0
