"""Compiled prefix hashing and the per-endpoint prefix index (velocity_fast/routing/prefix.pyx)."""

import os
import random
import subprocess
import sys

import pytest

from velocity_fast.routing.prefix import (
    BlockHashes,
    PrefixHasher,
    PrefixIndex,
    block_digest,
    choose_by_affinity,
    hash_bytes,
)

BLOCK = 64


def _prompt(nbytes: int, fill: int = 0) -> bytes:
    # Varied bytes so that no two blocks are equal by accident.
    return bytes((i * 31 + fill) % 251 for i in range(nbytes))


# -- hashing ---------------------------------------------------------------------------


def test_only_full_blocks_are_hashed():
    h = PrefixHasher(BLOCK)
    assert len(h.hash(b"", "m")) == 0
    assert len(h.hash(_prompt(63), "m")) == 0
    assert len(h.hash(_prompt(64), "m")) == 1
    assert len(h.hash(_prompt(64 * 5 + 63), "m")) == 5
    # The trailing partial block does not change the full blocks' hashes.
    data = _prompt(64 * 5 + 63)
    assert h.hash(data, "m").tolist() == h.hash(data[:320], "m").tolist()


def test_chained_changing_block_i_changes_every_later_hash_and_no_earlier_one():
    h = PrefixHasher(BLOCK)
    data = bytearray(_prompt(64 * 12))
    base = h.hash(bytes(data), "m").tolist()
    assert len(set(base)) == 12
    for i in (0, 5, 11):
        changed = bytearray(data)
        changed[i * 64 + 17] ^= 0x01  # one bit of block i
        got = h.hash(bytes(changed), "m").tolist()
        assert got[:i] == base[:i]
        assert all(g != b for g, b in zip(got[i:], base[i:]))


def test_a_repeated_block_hashes_differently_at_each_position():
    h = PrefixHasher(BLOCK)
    hashes = h.hash(b"x" * 64 * 8, "m").tolist()
    assert len(set(hashes)) == 8


def test_seeded_by_model_name_and_block_size():
    data = _prompt(64 * 4)
    a = PrefixHasher(BLOCK).hash(data, "llama").tolist()
    b = PrefixHasher(BLOCK).hash(data, "mistral").tolist()
    assert not set(a) & set(b)
    c = PrefixHasher(128).hash(data, "llama").tolist()
    assert not set(a) & set(c)


def test_accepts_bytes_like_objects():
    h = PrefixHasher(BLOCK)
    data = _prompt(64 * 3)
    want = h.hash(data, "m").tolist()
    assert h.hash(bytearray(data), "m").tolist() == want
    assert h.hash(memoryview(data), "m").tolist() == want
    with pytest.raises(TypeError):
        h.hash("text is not bytes", "m")


def test_block_size_must_be_a_multiple_of_32():
    for bad in (0, 16, 48, 100):
        with pytest.raises(ValueError):
            PrefixHasher(bad)
    assert PrefixHasher(96).block_bytes == 96


def test_hash_bytes_covers_every_byte_and_the_length():
    assert hash_bytes(b"abc") == hash_bytes("abc")
    assert hash_bytes(b"abc") != hash_bytes(b"abd")
    assert hash_bytes(b"abc") != hash_bytes(b"abc\x00")  # zero padding cannot collide
    assert hash_bytes(b"") != hash_bytes(b"\x00")
    assert hash_bytes(b"abc", 1) != hash_bytes(b"abc", 2)
    long = _prompt(1000)
    assert hash_bytes(long) != hash_bytes(long[:-1] + bytes([long[-1] ^ 1]))


_CHILD = """
import sys
from velocity_fast.routing.prefix import PrefixHasher, hash_bytes
data = bytes((i * 31) % 251 for i in range(64 * 6 + 10))
print(PrefixHasher(64).hash(data, "llama").tolist(), hash_bytes(b"session-1"))
"""


def test_stable_across_processes():
    # Different hash randomisation per process: Python's hash() would differ, ours must not.
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, env=env, check=True
        ).stdout
        outs.add(out)
    data = bytes((i * 31) % 251 for i in range(64 * 6 + 10))
    here = f"{PrefixHasher(64).hash(data, 'llama').tolist()} {hash_bytes(b'session-1')}\n"
    assert outs == {here}


def test_known_values_do_not_drift():
    # Pinned values: a change here re-keys every gateway's index and must be deliberate.
    data = bytes(range(256)) * 2
    assert PrefixHasher(64).hash(data, "m").tolist()[:2] == [819218398120104997, 15602817971598073942]
    assert hash_bytes(b"velocity") == 8853379761880632214


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def _digest_isas() -> list[str]:
    isas = ["c", "sse2"]
    try:
        block_digest(b"\0" * 64, "avx2")
        isas.append("avx2")
    except ValueError:
        # A GCC build on an x86-64 CPU with AVX2 must take it (CI's and ours do).
        assert not (
            _cpu_has_avx2() and sys.platform == "linux" and os.uname().machine == "x86_64" and "GCC" in sys.version
        )
    return isas


def test_the_block_digest_is_the_same_in_avx2_sse2_and_plain_c():
    # x86-64 hashes blocks four lanes at a time (AVX2) or two (SSE2); other hosts run the
    # plain C. A gateway's keys must not depend on which, so all must agree on every block.
    isas = _digest_isas()
    rnd = random.Random(5)
    for n in (32, 64, 96, 128, 256, 1024):
        for _ in range(200):
            block = bytes(rnd.getrandbits(8) for _ in range(n))
            assert len({block_digest(block, isa) for isa in isas}) == 1
    edge = [
        b"\x00" * 64,
        b"\xff" * 64,
        bytes(range(64)),
        b"\xff\xff\xff\xff" + b"\x00" * 60,
        b"\x00" * 60 + b"\xff\xff\xff\xff",
        (b"\x00" * 7 + b"\x80") * 8,
    ]
    for isa in isas:
        assert [block_digest(b, isa) for b in edge] == [block_digest(b, "c") for b in edge]
    assert len({block_digest(b) for b in edge}) == len(edge)
    # The stripes do not commute: a block with its halves swapped digests differently.
    a, b = bytes(range(32)), bytes(range(100, 132))
    assert block_digest(a + b) != block_digest(b + a)
    with pytest.raises(ValueError):
        block_digest(b"x" * 33)
    with pytest.raises(ValueError):
        block_digest(b"x" * 64, "neon")


_ISA_CHILD = """
import json
from velocity_fast.routing.blockscan import hash_body, hash_json
from velocity_fast.routing.prefix import PrefixHasher
data = bytes((i * 31 + i // 7) % 251 for i in range(64 * 300 + 10))
body = json.dumps({"model": "m", "messages": [
    {"role": "system", "content": "You are terse. " * 300},
    {"role": "user", "content": "Tell me about \\u00e9 and \\"quotes\\".\\n" * 400}]}).encode()
for block in (64, 128):
    h = PrefixHasher(block)
    print(h.hash(data, "m").tolist())
    print(hash_body(body, h, "m").tolist())
    print(hash_json(body, h, "m").tolist())
"""


def test_hashing_gives_the_same_keys_with_and_without_avx2():
    # The whole chain, through every path that hashes (PrefixHasher, the body scanner, the
    # raw-JSON hasher): VELOCITY_HASH_ISA=sse2 turns the AVX2 loop off in a fresh process.
    outs = {}
    for isa in ("auto", "sse2"):
        env = dict(os.environ, VELOCITY_HASH_ISA=isa)
        outs[isa] = subprocess.run(
            [sys.executable, "-c", _ISA_CHILD], capture_output=True, text=True, timeout=60, env=env, check=True
        ).stdout
    assert outs["auto"] == outs["sse2"]
    lines = outs["auto"].splitlines()
    assert len(lines) == 6 and all(len(eval(line)) >= 100 for line in lines)


# -- index -------------------------------------------------------------------------------


def _chain(n: int, fill: int = 0) -> BlockHashes:
    return PrefixHasher(BLOCK).hash(_prompt(64 * n, fill), "m")


def test_index_matches_leading_blocks_of_every_endpoint_in_one_pass():
    ix = PrefixIndex(1000)
    full = _chain(10)
    ix.touch("a", full)  # all 10 blocks
    ix.touch("b", BlockHashes.of(full.tolist()[:4]))  # the first 4
    ix.touch("c", _chain(10, fill=7))  # another prompt
    matched = ix.match(full)
    assert matched[ix.slot_of("a")] == 10
    assert matched[ix.slot_of("b")] == 4
    assert matched[ix.slot_of("c")] == 0
    # A hole at block 2 stops the leading match there even if later blocks are held.
    holes = full.tolist()
    ix.touch("d", BlockHashes.of(holes[:2] + holes[3:]))
    assert ix.match(full)[ix.slot_of("d")] == 2


def test_touch_reports_the_leading_blocks_already_held():
    ix = PrefixIndex(1000)
    full = _chain(8)
    assert ix.touch("a", BlockHashes.of(full.tolist()[:3])) == 0
    assert ix.touch("a", full) == 3
    assert ix.touch("a", full) == 8


def test_index_stays_within_its_bound_and_evicts_least_recently_used_first():
    ix = PrefixIndex(5)
    keys = [BlockHashes.of([k]) for k in range(1, 9)]
    for k in keys[:5]:
        ix.touch("a", k)
    assert ix.size("a") == 5 and len(ix) == 5
    ix.touch("a", keys[0])  # 1 is now the most recent; 2 is the oldest
    ix.touch("a", keys[5])  # inserting 6 evicts 2
    assert ix.lru_keys("a") == [6, 1, 5, 4, 3]
    ix.touch("a", keys[6])
    ix.touch("a", keys[7])
    assert ix.lru_keys("a") == [8, 7, 6, 1, 5]
    assert ix.size("a") == 5
    assert ix.match(BlockHashes.of([2]))[ix.slot_of("a")] == 0
    assert ix.match(BlockHashes.of([1]))[ix.slot_of("a")] == 1


def test_a_prompt_leading_blocks_are_evicted_last():
    ix = PrefixIndex(100)
    chain = _chain(4).tolist()
    ix.touch("a", BlockHashes.of(chain))
    assert ix.lru_keys("a") == chain  # block 0 most recent: a prefix without its head is useless


def test_bounds_are_per_endpoint_and_shrinking_evicts_at_once():
    ix = PrefixIndex(4)
    ix.set_capacity("big", 1000)
    ix.touch("big", _chain(50))
    ix.touch("small", _chain(50))
    assert ix.size("big") == 50 and ix.size("small") == 4
    ix.set_capacity("big", 10)
    assert ix.size("big") == 10 and len(ix) == 14
    assert ix.capacity("big") == 10 and ix.capacity("small") == 4
    ix.set_capacity("small", 0)
    assert ix.size("small") == 0
    ix.touch("small", _chain(3))
    assert ix.size("small") == 0


def test_shared_blocks_are_counted_once_per_endpoint_and_survive_other_evictions():
    ix = PrefixIndex(1000)
    chain = _chain(20)
    for name in ("a", "b", "c"):
        ix.touch(name, chain)
    st = ix.stats()
    assert st["blocks"] == 60 and st["distinct_blocks"] == 20
    ix.remove("b")
    m = ix.match(chain)
    assert m[ix.slot_of("a")] == 20 and m[ix.slot_of("c")] == 20
    assert ix.slot_of("b") == -1 and ix.stats()["distinct_blocks"] == 20


def test_sixty_four_slots_then_none_until_one_is_freed():
    ix = PrefixIndex(10)
    for i in range(64):
        assert ix.slot(f"e{i}") == i
    assert ix.slot("extra") == -1
    assert ix.touch("extra", _chain(3)) == 0 and ix.size("extra") == 0
    ix.remove("e7")
    assert ix.slot("extra") == 7
    assert ix.touch("extra", _chain(3)) == 0 and ix.size("extra") == 3


def test_churn_keeps_tables_consistent():
    # Many inserts and evictions through small LRUs exercise backward-shift deletion.
    ix = PrefixIndex(37)
    names = [f"e{i}" for i in range(6)]
    for round_ in range(300):
        ix.touch(names[round_ % 6], _chain(9, fill=round_ % 23))
    for name in names:
        assert ix.size(name) <= 37
        keys = ix.lru_keys(name)
        assert len(keys) == ix.size(name) == len(set(keys))
        # Everything listed is found, and matching agrees with the lists.
        for k in keys:
            assert ix.match(BlockHashes.of([k]))[ix.slot_of(name)] == 1
    assert len(ix) == sum(ix.size(n) for n in names)


# -- the chat scoring kernel ------------------------------------------------------------


class _Ep:
    def __init__(self, name):
        self.name = name


def test_kernel_prefers_affinity_within_the_gap_and_load_past_it():
    ix = PrefixIndex(1000)
    chain = _chain(8)
    eps = [_Ep("a"), _Ep("b"), _Ep("c")]
    ix.touch("a", chain)
    assert choose_by_affinity(ix, chain, eps, [4.0, 0.0, 0.0], 4.0, 0.25, 1) == (0, "prefix")
    assert choose_by_affinity(ix, chain, eps, [5.0, 0.0, 1.0], 4.0, 0.25, 1) == (1, "hotspot")
    assert choose_by_affinity(ix, _chain(8, fill=3), eps, [1.0, 0.0, 2.0], 4.0, 0.25, 9) == (1, "load")
    with pytest.raises(ValueError):
        choose_by_affinity(ix, chain, eps, [1.0], 4.0, 0.25, 1)


def test_kernel_spills_on_the_engine_queue_where_the_gauge_is_fresh():
    ix = PrefixIndex(1000)
    chain = _chain(8)
    eps = [_Ep("a"), _Ep("b"), _Ep("c")]
    ix.touch("a", chain)
    # a holds the prompt and carries 9 more than b (past the gap of 4) but queues nothing
    assert choose_by_affinity(ix, chain, eps, [9.0, 0.0, 6.0], 4.0, 0.0, 1, [0.0, 0.0, 0.0], 2.0) == (0, "prefix")
    ix.touch("c", chain)
    # a queues 2: the best of the others is c, which holds it too, not the least loaded b
    assert choose_by_affinity(ix, chain, eps, [9.0, 0.0, 10.0], 4.0, 0.25, 1, [0.0, 0.0, 0.0], 2.0) == (0, "prefix")
    assert choose_by_affinity(ix, chain, eps, [9.0, 0.0, 10.0], 4.0, 0.25, 1, [2.0, 0.0, 0.0], 2.0) == (2, "hotspot")
    # without a fresh gauge (-1) a falls back to the load gap: b and c are within it
    assert choose_by_affinity(ix, chain, eps, [9.0, 0.0, 10.0], 4.0, 0.25, 1, [-1.0, 0.0, 0.0], 2.0) == (2, "hotspot")
    assert choose_by_affinity(ix, chain, eps, [4.0, 0.0, 10.0], 4.0, 0.25, 1, [-1.0, 0.0, 0.0], 2.0) == (0, "prefix")
    # all queue: the least loaded
    assert choose_by_affinity(ix, chain, eps, [9.0, 0.0, 6.0], 4.0, 0.0, 1, [3.0, 2.0, 2.0], 2.0) == (1, "hotspot")
    with pytest.raises(ValueError):
        choose_by_affinity(ix, chain, eps, [1.0, 0.0, 0.0], 4.0, 0.25, 1, [0.0])


def test_kernel_breaks_ties_with_the_random_draw():
    ix = PrefixIndex(1000)
    eps = [_Ep(n) for n in "abcd"]
    picks = {choose_by_affinity(ix, _chain(2), eps, [0.0] * 4, 4.0, 0.25, r)[0] for r in range(40)}
    assert picks == {0, 1, 2, 3}
