"""The load client leaves its host's heap out of garbage collection while it times
requests: a test runner late in a long suite holds a large heap, and a full collection
that walks it is a pause every request waiting on the event loop pays for."""

import gc
import time

from velocity_fast.loadgen.client import frozen_heap


def _full_collection_s() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def test_a_full_collection_does_not_walk_the_held_heap_while_frozen():
    held = [{"i": i, "v": [i]} for i in range(1_000_000)]
    walked = min(_full_collection_s() for _ in range(3))
    with frozen_heap():
        assert gc.get_freeze_count() >= len(held)
        frozen = min(_full_collection_s() for _ in range(3))
    # Walking two million containers takes tens of milliseconds; frozen, the collection
    # sees only what the run itself allocated.
    assert frozen * 10 < walked, (frozen, walked)
    assert gc.get_freeze_count() == 0


def test_nested_runs_give_the_heap_back_once_the_outer_one_ends():
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
