"""routing/precise/affinity.score (precise routing's pick over known affinities) decides exactly as
the approximate path's compiled choose_by_affinity does for the same affinities."""

from __future__ import annotations

import random

import pytest

from velocity_fast.routing.precise.affinity import score
from velocity_fast.routing.prefix import BlockHashes, PrefixIndex, choose_by_affinity


class Ep:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize("seed", range(20))
def test_score_agrees_with_choose_by_affinity(seed):
    rng = random.Random(seed)
    chain = [rng.getrandbits(63) + 1 for _ in range(12)]
    index = PrefixIndex(1024)
    # Small pools are scored on the stack, pools past 16 in memory of their own.
    eps = [Ep(f"e{i}") for i in range(rng.randint(1, 6) if seed % 2 else rng.randint(15, 40))]
    for ep in eps:
        held = rng.choice([0, 0, 3, 6, 12])
        if held:
            index.touch(ep.name, BlockHashes.of(chain[:held]))
    hashes = BlockHashes.of(chain)
    matched = index.match(hashes)
    aff = [(matched[index.slot_of(ep.name)] if index.slot_of(ep.name) >= 0 else 0) / len(chain) for ep in eps]
    for _ in range(50):
        loads = [float(rng.choice([0, 1, 2, 9, 12])) for _ in eps]
        gap, weight, rand = rng.choice([8.0, 2.0, 0.0]), rng.choice([0.25, 1.0]), rng.getrandbits(64)
        assert score(aff, loads, gap, weight, rand) == choose_by_affinity(index, hashes, eps, loads, gap, weight, rand)
        waits = [float(rng.choice([-1, 0, 1, 2, 5])) for _ in eps]
        assert score(aff, loads, gap, weight, rand, waits, 2.0) == choose_by_affinity(
            index, hashes, eps, loads, gap, weight, rand, waits, 2.0
        )


def test_bad_lengths_are_an_error():
    with pytest.raises(ValueError):
        score([], [], 8.0, 0.25, 1)
    with pytest.raises(ValueError):
        score([0.5], [1.0, 2.0], 8.0, 0.25, 1)
    with pytest.raises(ValueError):
        score([0.5, 0.5], [1.0, 2.0], 8.0, 0.25, 1, [0.0])
