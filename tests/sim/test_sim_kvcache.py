"""KV block accounting and automatic prefix caching of the sim engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.sim.kvcache import KVCache
from velocity_fast.sim.tokens import block_hashes, count_tokens, request_rng

BS = 16


def prompt(tag: str, blocks: int) -> tuple[list[int], int]:
    data = (tag * (BS * 4 * blocks))[: BS * 4 * blocks]
    return block_hashes(data.encode(), BS, b"m"), count_tokens(data.encode())


def test_a_sequence_holds_ceil_tokens_over_block_size():
    kv = KVCache(10, BS, 10)
    alloc, hit = kv.allocate_prompt([], 33)
    assert alloc.num_blocks == 3 and hit == 0 and kv.used == 3
    assert kv.usage == pytest.approx(0.3)
    assert kv.grow(alloc, 1) and kv.used == 4
    kv.release(alloc)
    assert kv.used == 0 and kv.free == 10


def test_second_identical_prompt_hits_all_but_the_last_block():
    kv = KVCache(100, BS, 100)
    hashes, tokens = prompt("a", 4)
    a, hit_a = kv.allocate_prompt(hashes, tokens, 1)
    b, hit_b = kv.allocate_prompt(hashes, tokens, 1)
    assert hit_a == 0
    # the whole prompt is cached, but the last block is recomputed (its logits are needed)
    assert hit_b == 3 * BS
    assert kv.hits == 3 * BS and kv.queries == 2 * tokens
    # shared blocks are held once: 4 + 1 (a) and 1 + 1 fresh blocks (b)
    assert kv.used == 5 + 2
    kv.release(a)
    kv.release(b)
    assert kv.used == 0


def test_freed_blocks_stay_reusable_until_evicted():
    kv = KVCache(8, BS, 8)
    hashes, tokens = prompt("b", 4)
    a, _ = kv.allocate_prompt(hashes, tokens + 5)
    kv.release(a)
    assert kv.cached_prefix(hashes) == 4
    # a different prompt that needs every block evicts the cached ones (oldest first)
    other, otokens = prompt("c", 8)
    c, hit = kv.allocate_prompt(other, otokens)
    assert hit == 0 and kv.free == 0
    assert kv.cached_prefix(hashes) == 0


def test_prefix_cache_blocks_bounds_the_lru():
    kv = KVCache(50, BS, 1)
    hashes, tokens = prompt("d", 4)
    a, _ = kv.allocate_prompt(hashes, tokens + 1)
    kv.release(a)
    # only the most recently freed block kept its content: blocks are freed tail first
    # (as vLLM frees them), so the one kept is the chain's head, still usable
    assert kv.cached_prefix(hashes) == 1
    assert kv.free == 50


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCache(5, BS, 5)
    hashes, tokens = prompt("e", 3)
    a, _ = kv.allocate_prompt(hashes, tokens)
    before = (kv.used, kv.free, kv.queries, kv.hits)
    big, btokens = prompt("f", 4)
    assert kv.allocate_prompt(big, btokens) is None
    assert (kv.used, kv.free, kv.queries, kv.hits) == before
    assert not kv.grow(a, 3)
    assert kv.grow(a, 2) and kv.free == 0


def test_disabled_prefix_caching_never_hits():
    kv = KVCache(100, BS, 100, enable_prefix_caching=False)
    hashes, tokens = prompt("g", 4)
    kv.release(kv.allocate_prompt(hashes, tokens)[0])
    _, hit = kv.allocate_prompt(hashes, tokens)
    assert hit == 0 and kv.hits == 0 and kv.queries == 0


def test_block_hashes_are_chained():
    a = block_hashes(b"x" * 64 * 3, BS, b"m")
    b = block_hashes(b"x" * 64 * 2 + b"y" * 64, BS, b"m")
    c = block_hashes(b"y" + b"x" * (64 * 3 - 1), BS, b"m")
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # same block content after a different first block: a different hash all along
    assert all(x != y for x, y in zip(a, c))
    assert block_hashes(b"x" * 63, BS, b"m") == []  # only full blocks
    assert block_hashes(b"x" * 64, BS, b"m") != block_hashes(b"x" * 64, BS, b"other-model")


def test_request_rng_depends_on_seed_and_content_only():
    r1 = [request_rng(1, b"hello").getrandbits(10) for _ in range(3)]
    assert r1 == [request_rng(1, b"hello").getrandbits(10) for _ in range(3)]
    a, b, c = request_rng(1, b"hello"), request_rng(2, b"hello"), request_rng(1, b"hellp")
    seqs = [[r.getrandbits(32) for _ in range(4)] for r in (a, b, c)]
    assert seqs[0] != seqs[1] and seqs[0] != seqs[2]


def test_tokens_are_about_four_bytes():
    assert count_tokens(b"") == 1
    assert count_tokens(b"abcd") == 1 and count_tokens(b"abcde") == 2
    assert count_tokens(b"x" * 4000) == 1000


_op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 3), st.integers(1, 6)),  # prompt family, blocks
    st.tuples(st.just("grow"), st.integers(0, 20), st.integers(1, 3)),
    st.tuples(st.just("release"), st.integers(0, 20), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=60), lru=st.integers(0, 12))
def test_block_counts_always_add_up(ops, lru):
    kv = KVCache(12, BS, lru)
    live = []
    for op, a, b in ops:
        if op == "alloc":
            hashes, tokens = prompt("abcd"[a], b)
            got = kv.allocate_prompt(hashes, tokens, 1)
            if got is not None:
                live.append(got[0])
                assert got[1] < tokens
        elif op == "grow" and live:
            kv.grow(live[a % len(live)], b)
        elif op == "release" and live:
            kv.release(live.pop(a % len(live)))
        held = sum(x.num_blocks for x in live)
        # shared prompt blocks are counted once in `used`
        assert 0 <= kv.used <= held
        assert kv.used + kv.free == kv.num_blocks
        assert len(kv._lru) <= lru
    for x in live:
        kv.release(x)
    assert kv.used == 0 and kv.free == kv.num_blocks


def test_events_name_stored_runs_evictions_and_resets():
    from velocity_fast.sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored

    kv = KVCache(6, BS, 6)
    kv.events = []
    hashes, tokens = prompt("f", 4)
    ids = list(range(tokens))
    a, _ = kv.allocate_prompt(hashes, tokens + 1, 0, ids)
    (ev,) = kv.events
    assert isinstance(ev, BlockStored) and ev.parent_block_hash is None
    assert ev.block_hashes == [h & (2**64 - 1) for h in hashes] and ev.token_ids == ids[: 4 * BS]
    assert not kv.reset()  # blocks in use: nothing happens
    kv.release(a)
    kv.events.clear()
    # A prompt that needs every block evicts the cached ones, tail first, one event each.
    other, t2 = prompt("g", 5)
    b, _ = kv.allocate_prompt(other, t2, 0, list(range(t2)))
    removed = [e.block_hashes[0] for e in kv.events if isinstance(e, BlockRemoved)]
    assert removed == [h & (2**64 - 1) for h in reversed(hashes)][: len(removed)] and len(removed) >= 3
    kv.release(b)
    kv.events.clear()
    assert kv.reset() and kv.cached_prefix(other) == 0
    assert kv.events == [AllBlocksCleared()]
