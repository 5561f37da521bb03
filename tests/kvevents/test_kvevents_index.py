"""The precise block index: events in vLLM's layout give the right match counts, and the
subscriber recovers gaps through replay or falls back to approximate until it resyncs."""

from __future__ import annotations

import pytest

from tests.kvevents import vllm_wire as W
from velocity_fast.kvevents.index import BlockIndex, chain_hashes
from velocity_fast.kvevents.subscriber import Subscriber
from velocity_fast.kvevents.wire import decode_batch

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def apply(index: BlockIndex, key, *events) -> None:
    index.apply(key, decode_batch(W.batch(list(events)))[1])


@pytest.mark.parametrize("arrays", [False, True], ids=["maps", "arrays"])
def test_stored_removed_cleared_give_the_right_matches(arrays):
    idx = BlockIndex()
    ids = toks(16)  # 4 full blocks
    chain = chain_hashes(ids + [99, 98], BS)  # the partial tail has no hash
    assert len(chain) == 4
    # The engine's hashes are its own business: arbitrary numbers and bytes.
    eh = [1001, b"\x07" * 32, 1003, 1004]
    apply(idx, "a", W.stored(eh[:2], None, ids[:8], BS, arrays=arrays))
    assert idx.match("a", chain) == 2
    # A later run names its parent by the engine's hash.
    apply(idx, "a", W.stored(eh[2:], eh[1], ids[8:], BS, arrays=arrays))
    assert idx.match("a", chain) == 4
    assert idx.size("a") == 4 and idx.block_size("a") == BS
    # Another endpoint holds nothing; a different prompt matches only its shared prefix.
    assert idx.match("b", chain) == 0
    other = chain_hashes(ids[:8] + toks(8, 500), BS)
    assert idx.match("a", other) == 2
    # Evicting a middle block cuts the match there.
    apply(idx, "a", W.removed([eh[2]], arrays=arrays))
    assert idx.match("a", chain) == 2 and idx.size("a") == 3
    apply(idx, "a", W.cleared(arrays=arrays))
    assert idx.match("a", chain) == 0 and idx.size("a") == 0


def test_a_block_stored_twice_stays_until_removed_twice():
    # vLLM does not deduplicate: two physical blocks may carry one hash.
    idx = BlockIndex()
    ids = toks(4)
    apply(idx, "a", W.stored([7], None, ids, BS), W.stored([7], None, ids, BS))
    apply(idx, "a", W.removed([7]))
    assert idx.match("a", chain_hashes(ids, BS)) == 1
    apply(idx, "a", W.removed([7]))
    assert idx.match("a", chain_hashes(ids, BS)) == 0


def test_unknown_parent_other_media_and_extra_keys_are_not_indexed():
    idx = BlockIndex()
    ids = toks(8)
    apply(idx, "a", W.stored([2], 12345, ids[4:], BS))  # parent never seen
    apply(idx, "a", W.stored([1], None, ids[:4], BS, medium="CPU"))
    assert idx.size("a") == 0
    s = idx.stats("a")
    assert s.orphans == 1 and s.skipped == 1
    # A block whose hash covers an image (extra_keys) never matches a text prompt.
    ev = W.stored([1], None, ids[:4], BS)
    ev["extra_keys"] = [["mm-hash-abc", 0]]
    apply(idx, "a", ev)
    assert idx.size("a") == 1 and idx.match("a", chain_hashes(ids, BS)) == 0


def test_chain_hashes_agree_across_processes():
    import subprocess
    import sys

    code = "from velocity_fast.kvevents.index import chain_hashes; print(chain_hashes(list(range(40)), 16))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and outs.pop().strip() == str(chain_hashes(list(range(40)), 16))


@pytest.fixture
def publisher():
    pub = W.Publisher()
    yield pub
    pub.close()


def connected(pub: W.Publisher, idx: BlockIndex, key) -> None:
    """Publish empty batches until one arrives live (the subscription is in place)."""
    s = idx.stats(key)
    for _ in range(200):
        n = s.batches
        pub.send([])
        try:
            W.wait_for(lambda: s.batches > n, 0.05)
            return
        except AssertionError:
            continue
    raise AssertionError("subscriber never received a batch")


def test_subscriber_follows_the_stream_and_recovers_a_gap_by_replay(publisher):
    idx = BlockIndex()
    sub = Subscriber(idx, "e1", publisher.endpoint, publisher.replay_endpoint, topic="kv").start()
    try:
        connected(publisher, idx, "e1")
        assert idx.exact("e1")
        ids = toks(12)
        chain = chain_hashes(ids, BS)
        lost0, replayed0 = idx.stats("e1").lost, idx.stats("e1").replayed
        publisher.send([W.stored([11], None, ids[:4], BS)])
        # This batch is lost on the live stream: the next one reveals the gap.
        publisher.send([W.stored([12], 11, ids[4:8], BS)], live=False)
        publisher.send([W.stored([13], 12, ids[8:], BS)])
        W.wait_for(lambda: idx.match("e1", chain) == 3, what="all three blocks")
        s = idx.stats("e1")
        assert s.lost - lost0 == 1 and s.replayed - replayed0 == 1
        assert s.unrecovered == 0 and idx.exact("e1")
    finally:
        sub.stop()


def test_without_replay_a_gap_makes_the_endpoint_approximate_until_a_clear():
    pub = W.Publisher(replay=False)
    idx = BlockIndex()
    sub = Subscriber(idx, "e1", pub.endpoint, None, topic="kv").start()
    try:
        connected(pub, idx, "e1")
        ids = toks(8)
        pub.send([W.stored([21], None, ids[:4], BS)])
        pub.send([W.removed([21])], live=False)  # the engine evicted it; we never hear
        pub.send([W.stored([22], 21, ids[4:], BS)])
        W.wait_for(lambda: idx.stats("e1").unrecovered >= 1, what="the gap")
        assert not idx.exact("e1")
        # The stale entry is still there: that is why the router must not trust it.
        assert idx.match("e1", chain_hashes(ids, BS)) == 2
        resyncs = idx.stats("e1").resyncs
        pub.send([W.cleared()])  # the engine's cache emptied: known again
        W.wait_for(lambda: idx.exact("e1"), what="resync")
        assert idx.stats("e1").resyncs == resyncs + 1 and idx.size("e1") == 0
        pub.send([W.stored([31], None, ids[:4], BS)])
        W.wait_for(lambda: idx.match("e1", chain_hashes(ids, BS)) == 1, what="refill")
    finally:
        sub.stop()
        pub.close()


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.32", "older"])
def test_a_subscriber_that_starts_late_rebuilds_from_the_replay_buffer(replay_topic):
    # vLLM 0.32 answers a replay with (b"", topic, seq, payload); engines before it
    # without the topic. A subscriber that read only the older framing timed out on
    # every replay from a real engine.
    publisher = W.Publisher(replay_topic=replay_topic)
    try:
        _late_rebuild(publisher)
    finally:
        publisher.close()


def _late_rebuild(publisher):
    ids = toks(8)
    publisher.send([W.stored([41, 42], None, ids, BS)])
    publisher.send([W.removed([42])])
    idx = BlockIndex()
    sub = Subscriber(idx, "e1", publisher.endpoint, publisher.replay_endpoint, topic="kv").start()
    try:
        W.wait_for(lambda: idx.exact("e1") and idx.size("e1") == 1, what="rebuild from replay")
        assert idx.match("e1", chain_hashes(ids, BS)) == 1
    finally:
        sub.stop()


def test_a_subscriber_joining_past_the_replay_buffer_is_exact_at_once_and_learns_from_hints():
    # The engine ran longer than its buffer keeps: batch 0 is gone for good. The
    # subscriber must not wait for it; it starts exact, as a subset of the engine's blocks.
    pub = W.Publisher(buffer_steps=2)
    ids = toks(12)
    chain = chain_hashes(ids, BS)
    pub.send([W.stored([61, 62], None, ids[:8], BS)])  # before the gateway joined
    for _ in range(3):
        pub.send([])  # the buffer rolls past it
    idx = BlockIndex()
    sub = Subscriber(idx, "e1", pub.endpoint, pub.replay_endpoint, topic="kv").start()
    try:
        W.wait_for(lambda: idx.exact("e1"), 2.0, what="joined")
        s = idx.stats("e1")
        assert s.joins == 1 and idx.match("e1", chain) == 0  # what came before is unknown
        # A store whose parent the events never named: unknown without a hint...
        pub.send([W.stored([64], 61, toks(4, 100), BS)])
        W.wait_for(lambda: s.orphans == 1, what="the orphan")
        # ...and with one (a prompt the gateway sent there), its prefix is known held.
        idx.hint("e1", chain)
        pub.send([W.stored([63], 62, ids[8:], BS)])
        W.wait_for(lambda: idx.match("e1", chain) == 3, what="the adopted prefix")
        assert s.adopted == 2 and idx.exact("e1")
        # The engine evicts block 62 (known by now): the blocks under it are open again.
        pub.send([W.removed([63, 62])])
        W.wait_for(lambda: idx.match("e1", chain) == 1, what="eviction of the parent")
        # A block the events never named leaves: what was known only by inference goes.
        pub.send([W.removed([99])])
        W.wait_for(lambda: idx.match("e1", chain) == 0, what="inferred blocks dropped")
    finally:
        sub.stop()
        pub.close()


def test_a_dropped_connection_clears_the_endpoint(publisher):
    idx = BlockIndex()
    sub = Subscriber(idx, "e1", publisher.endpoint, publisher.replay_endpoint, topic="kv").start()
    try:
        connected(publisher, idx, "e1")
        publisher.send([W.stored([51], None, toks(4), BS)])
        W.wait_for(lambda: idx.size("e1") == 1, what="the block")
        publisher.close()  # the engine is gone
        W.wait_for(lambda: idx.stats("e1").disconnects >= 1, what="the disconnect")
        assert idx.size("e1") == 0 and not idx.exact("e1")
    finally:
        sub.stop()


def test_chain_hashes_extend_a_known_prefix():
    turn1 = toks(10)
    turn2 = turn1 + toks(9, 100)
    first = chain_hashes(turn1, BS)
    assert chain_hashes(turn2, BS, known=first) == chain_hashes(turn2, BS)
    assert chain_hashes(turn1, BS, lora="adapter-a")[0] != first[0]


# -- match against a plain model: any order of stores, evictions and clears -----------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DEPTH = 3
# A node is a path of tokens (block size 1, tokens 0 or 1): a binary tree of prompts.
NODES = [tuple(int(c) for c in format(i, f"0{d}b")) for d in range(1, DEPTH + 1) for i in range(2**d)]
LEAVES = [n for n in NODES if len(n) == DEPTH]


def engine_hash(node) -> int:
    return 1000 + NODES.index(node)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(NODES), st.integers(1, 3)),
        st.tuples(st.just("remove"), st.sampled_from(NODES)),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_match_equals_a_linear_scan_of_what_the_engine_holds(ops):
    idx = BlockIndex()
    refs: dict[tuple, int] = {}  # the model: node -> stores not yet removed
    for op in ops:
        if op[0] == "store":
            # A run of up to 3 blocks down the tree from a node, as one event.
            # The engine stores under a parent it holds: start at the first block of
            # the node's path that is not held (or the node itself).
            target, length = op[1], op[2]
            node = next((target[:d] for d in range(1, len(target) + 1) if not refs.get(target[:d])), target)
            run = [node]
            while len(run) < length and len(run[-1]) < DEPTH:
                run.append(run[-1] + (target + (0,) * DEPTH)[len(run[-1]) : len(run[-1]) + 1])
            parent = node[:-1]
            ev = W.stored(
                [engine_hash(n) for n in run], engine_hash(parent) if parent else None, list(run[-1][len(parent) :]), 1
            )
            apply(idx, "e", ev)
            for n in run:
                refs[n] = refs.get(n, 0) + 1
        elif op[0] == "remove":
            if refs.get(op[1], 0):
                apply(idx, "e", W.removed([engine_hash(op[1])]))
                refs[op[1]] -= 1
        else:
            apply(idx, "e", W.cleared())
            refs.clear()
    for leaf in LEAVES:
        expect = 0
        while expect < DEPTH and refs.get(leaf[: expect + 1], 0):
            expect += 1
        assert idx.match("e", chain_hashes(list(leaf), 1)) == expect, leaf
    assert idx.size("e") == sum(1 for v in refs.values() if v)
