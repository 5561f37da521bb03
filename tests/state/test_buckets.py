"""One bucket, three homes (state/bucket.pyx): the same draws and settlements give the same
answers whether the bucket lives in this process, in a real shared-memory segment the
workers map, or in a real Redis behind the state store (one replica: its view is exact)."""

from __future__ import annotations

import time

import pytest

from tests.support.gateway import wait_until
from tests.support.redis_server import redis_server
from velocity_fast.state.bucket import LocalBucket, ShmBucket, StoreBucket, make_bucket
from velocity_fast.state.shm import SharedState, attach, detach
from velocity_fast.state.store import StateStore

pytestmark = pytest.mark.timeout(60)

CAP = 100.0
RATE = 0.001  # units a second: no refill to speak of while the test runs

# (operation, amount, need): a draw answers allowed or not, a settlement moves the level;
# after each step the level left is compared.
STEPS = [
    ("draw", 30.0, 30.0),  # 70 left
    ("draw", 50.0, 50.0),  # 20 left
    ("draw", 30.0, 30.0),  # refused: 20 < 30
    ("settle", -10.0, 0.0),  # the answer used 10 fewer than drawn: 30 left
    ("draw", 30.0, 30.0),  # 0 left
    ("settle", 5.0, 0.0),  # 5 more than drawn: a debt, -5
    ("draw", 1.0, 1.0),  # refused: in debt
    ("draw", 500.0, CAP),  # past the bucket's size: needs a full one, refused
]


def _run(bucket, settled=lambda: None) -> list[tuple[bool | None, float]]:
    out = []
    for op, amount, need in STEPS:
        allowed = None
        if op == "draw":
            wait = bucket.draw(amount, need)
            assert wait >= 0.0
            allowed = wait == 0.0
        else:
            bucket.settle(amount)
        settled()
        out.append((allowed, round(bucket.left(), 1)))
    return out


def test_local_answers_as_a_token_bucket_should():
    got = _run(LocalBucket(RATE, CAP))
    assert [a for a, _ in got] == [True, True, False, None, True, None, False, False]
    assert [left for _, left in got] == [70.0, 20.0, 20.0, 30.0, 0.0, -5.0, -5.0, -5.0]


def test_shared_memory_answers_as_the_local_bucket(tmp_path):
    seg = SharedState.create(str(tmp_path / "shm"), 1)
    try:
        attach(seg, 0)
        shm = make_bucket("acme", "tokens", RATE, CAP)
        assert isinstance(shm, ShmBucket)
        assert _run(shm) == _run(LocalBucket(RATE, CAP))
    finally:
        detach()
        seg.unlink()


async def test_the_store_answers_as_the_local_bucket():
    expected = _run(LocalBucket(RATE, CAP))
    with redis_server() as rs:
        store = StateStore(rs.url)
        b = make_bucket("acme", "tokens", RATE, CAP, store)
        assert isinstance(b, StoreBucket)
        store.buckets = {b.key: b}
        await store.start()
        try:
            assert store.up and b.held > 0
            got = []
            for op, amount, need in STEPS:
                allowed = None
                if op == "draw":
                    allowed = b.draw(amount, need) == 0.0
                else:
                    b.settle(amount)
                # Each step's settlements and refill reach Redis before the next (a bucket
                # too short for its refill asks again later: not waited for).
                await wait_until(
                    lambda: not store._owing and (not b.asking or b.not_before > time.monotonic()),
                    3.0,
                    what="the round trip",
                )
                got.append((allowed, round(b.left(), 1)))
            assert got == expected
            level = float(rs.command("HGET", b.key, "level").split(b"\r\n")[1])
            assert round(level + b.held, 1) == expected[-1][1]  # what Redis holds, and this share
        finally:
            await store.close()
