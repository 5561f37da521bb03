"""A long prompt's chain thinned past its head (BlockHashes.thin): the index touches a
256 KiB prompt's 316 keys instead of its 4,096 blocks, counts capacity in blocks (the
blocks after the last whole step too, as the engine holds them), and a conversation's
next turn still extends the last one's chain."""

from __future__ import annotations

import pytest

from tests.support.fleet import make_pool
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.prefix import THIN_BLOCKS_AFTER, THIN_BLOCKS_FACTOR, BlockHashes, PrefixHasher, PrefixIndex
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings

pytestmark = pytest.mark.timeout(60)


def test_thinning_keeps_the_head_then_every_factorth_hash():
    full = BlockHashes.of(list(range(1, 1001)))
    t = full.thinned(256, 16)
    assert (t.fine, t.coarse) == (256, 16)
    # ... and the last hash, for the 8 blocks after the last whole step: all 1,000 count.
    assert t.tolist() == list(range(1, 257)) + list(range(256 + 16, 1001, 16)) + [1000]
    assert t.tail == 8 and t.blocks == 1000
    even = BlockHashes.of(list(range(1, 257 + 32))).thinned(256, 16)
    assert even.tolist() == list(range(1, 257)) + [272, 288] and even.tail == 0 and even.blocks == 288
    short = BlockHashes.of([7, 8, 9]).thinned(256, 16)
    assert short.tolist() == [7, 8, 9] and short.blocks == 3


def test_a_next_turns_thinned_chain_extends_the_last_ones():
    h = PrefixHasher(64)
    words = " ".join(f"word{i}" for i in range(60000)).encode()
    for cut in (20000, 100000, 262144):
        a = h.hash(words[:cut], "m").thinned(THIN_BLOCKS_AFTER, THIN_BLOCKS_FACTOR)
        b = h.hash(words[: cut + 5000], "m").thinned(THIN_BLOCKS_AFTER, THIN_BLOCKS_FACTOR)
        whole = len(a) - (1 if a.tail else 0)  # the tail's hash names a prefix b steps past
        assert b.tolist()[:whole] == a.tolist()[:whole]
        assert len(b) > len(a)
        assert (a.fine, a.blocks) == (64, cut // 64) and len(a) <= 64 + (cut // 64 - 64) // 16 + 1


def test_the_index_weighs_coarse_keys_as_the_blocks_they_stand_for():
    ix = PrefixIndex(100000)
    t = BlockHashes.of(list(range(1, 4097))).thinned(256, 16)
    assert len(t) == 256 + 240 and t.blocks == 4096
    assert ix.touch("a", t) == 0
    assert ix.size("a") == 4096 and len(ix.lru_keys("a")) == 496
    assert ix.touch("a", t) == 4096  # held: in blocks
    assert ix.match(t)[ix.slot_of("a")] == 4096
    half = BlockHashes.of(list(range(1, 2049))).thinned(256, 16)
    assert ix.match(half)[ix.slot_of("a")] == 2048
    ix.set_capacity("a", 1000)  # the tail goes first, weight by weight
    assert ix.size("a") <= 1000
    assert ix.match(t)[ix.slot_of("a")] == ix.size("a")  # what is left is the chain's head
    ix.set_capacity("a", 8)  # below one coarse key: the head blocks only
    assert ix.size("a") == 8
    odd = BlockHashes.of(list(range(5001, 6001))).thinned(64, 16)  # 1,000 blocks: a tail of 8
    assert ix.touch("b", odd) == 0
    assert ix.size("b") == 1000  # as the engine holds them
    assert ix.match(odd)[ix.slot_of("b")] == 1000


def test_the_router_routes_a_256_kib_prompts_next_turn_to_where_it_went():
    pool = make_pool(3)
    r = Router(RoutingSettings(seed=3), registry=Registry())
    text = " ".join(f"w{i}" for i in range(52000))
    turn1 = {"messages": [{"role": "user", "content": text[:262000]}]}
    turn2 = {
        "messages": [
            {"role": "user", "content": text[:262000]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and then?"},
        ]
    }
    info1 = r.route_info("m", turn1, {})
    assert info1.nblocks > 4000 and len(info1.hashes) < 330  # blocks stood for, keys touched
    r.on_dispatch(pool.endpoints[1], info1)
    info2 = r.route_info("m", turn2, {})
    assert {r.pick(pool, info2).name for _ in range(10)} == {"e1"}
    assert r.stats()["prefix_index"]["pools"]["m"]["endpoints"]["e1"]["blocks"] == info1.nblocks
