"""The sim engine's step loop without HTTP: batching, KV waiting, preemption, aborts,
step timing and determinism, driven through a recording sink."""

from __future__ import annotations

import asyncio
import time

import pytest

from velocity_fast.sim.engine import DONE, Engine, Failure, Sequence
from velocity_fast.sim.settings import SimConfig
from velocity_fast.sim.tokens import block_hashes, count_tokens, request_rng


class RecordingSink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.finish: str | None = None
        self.error = None
        self.was_aborted = False
        self.done = asyncio.get_running_loop().create_future()

    def token(self, tok, finish_reason):
        self.tokens.append(tok)
        self.times.append(time.monotonic())
        if finish_reason is not None:
            self.finish = finish_reason
            self.done.set_result(None)
        return False

    def fail(self, status, type, message):
        self.error = (status, type, message)
        self.done.set_result(None)
        return False

    def flush(self):
        pass

    def aborted(self):
        self.was_aborted = True
        if not self.done.done():
            self.done.set_result(None)


def make(cfg: SimConfig, text: str, max_tokens: int, failure: Failure | None = None):
    data = text.encode()
    sink = RecordingSink()
    seq = Sequence(
        count_tokens(data),
        block_hashes(data, cfg.block_size, b"m"),
        max_tokens,
        "length",
        request_rng(cfg.seed, data),
        sink,
        failure,
    )
    return seq, sink


@pytest.fixture
async def engine_factory():
    engines: list[Engine] = []

    def factory(**kw) -> Engine:
        kw.setdefault("time_scale", 20.0)
        cfg = SimConfig(model="m", **kw)
        cfg.validate()
        eng = Engine(cfg)
        eng.start()
        engines.append(eng)
        return eng

    yield factory
    for e in engines:
        await e.stop()


async def test_never_more_than_max_num_seqs(engine_factory):
    eng = engine_factory(max_num_seqs=2)
    seqs = [make(eng.cfg, f"req {i}", 10) for i in range(5)]
    for s, _ in seqs:
        eng.submit(s)
    await asyncio.wait_for(asyncio.gather(*(k.done for _, k in seqs)), 10)
    assert eng.max_running_seen == 2
    assert all(len(k.tokens) == 10 and k.finish == "length" for _, k in seqs)
    assert eng.kv.used == 0 and not eng.running and not eng.waiting


async def test_head_of_line_blocking_on_kv_blocks(engine_factory):
    # 20 blocks. A holds 12; the head of the queue (B, 12 blocks) cannot fit, and C
    # (1 block) waits behind it although it would fit.
    eng = engine_factory(num_gpu_blocks=20, max_model_len=320, time_scale=2.0)
    a, ka = make(eng.cfg, "a" * (64 * 11), 15)
    b, kb = make(eng.cfg, "b" * (64 * 11), 5)
    c, kc = make(eng.cfg, "c", 5)
    for s in (a, b, c):
        eng.submit(s)
    await asyncio.sleep(0.05)
    assert len(eng.running) == 1 and len(eng.waiting) == 2
    assert not kc.tokens
    await asyncio.wait_for(asyncio.gather(ka.done, kb.done, kc.done), 10)
    # C ran only once A had freed its blocks and B was admitted
    assert kc.times[0] > ka.times[-1]


async def test_preemption_recomputes_and_finishes(engine_factory):
    eng = engine_factory(num_gpu_blocks=10, max_model_len=160, time_scale=100.0)
    pairs = [make(eng.cfg, f"{i}" * 40, 140) for i in range(2)]
    for s, _ in pairs:
        eng.submit(s)
    await asyncio.wait_for(asyncio.gather(*(k.done for _, k in pairs)), 20)
    assert eng.metrics.preemptions >= 1
    assert [len(k.tokens) for _, k in pairs] == [140, 140]
    assert eng.kv.used == 0


async def test_abort_frees_blocks_at_once(engine_factory):
    eng = engine_factory(max_num_seqs=1)
    run, krun = make(eng.cfg, "r" * 400, 10_000 // 4)
    wait, kwait = make(eng.cfg, "w", 5)
    eng.submit(run)
    eng.submit(wait)
    await asyncio.sleep(0.05)
    assert eng.kv.used > 0 and len(eng.waiting) == 1
    eng.abort(wait)
    assert kwait.was_aborted and not eng.waiting
    eng.abort(run)
    assert krun.was_aborted and run.state == DONE
    assert eng.kv.used == 0 and not eng.running
    n = len(krun.tokens)
    await asyncio.sleep(0.03)
    assert len(krun.tokens) == n


async def test_step_time_grows_with_batch(engine_factory):
    # 50 tok/s at time scale 5: 4 ms a step alone; contention 1.0 doubles it at batch 2
    # and makes it 8x at batch 8.
    async def itl(batch: int, contention: float) -> float:
        eng = engine_factory(batch_contention=contention, max_num_seqs=64, time_scale=5.0)
        pairs = [make(eng.cfg, f"s{i}", 20) for i in range(batch)]
        for s, _ in pairs:
            eng.submit(s)
        await asyncio.wait_for(asyncio.gather(*(k.done for _, k in pairs)), 20)
        k = pairs[0][1]
        return (k.times[-1] - k.times[1]) / (len(k.times) - 2)

    alone = await itl(1, 1.0)
    crowded = await itl(8, 1.0)
    assert 4.0 < crowded / alone < 16.0, (alone, crowded)
    flat = await itl(8, 0.0)
    assert flat / alone < 2.5


async def test_same_content_same_tokens_regardless_of_company(engine_factory):
    eng = engine_factory(seed=5)
    s1, k1 = make(eng.cfg, "same prompt", 20)
    eng.submit(s1)
    await k1.done
    others = [make(eng.cfg, f"other {i}", 20) for i in range(3)]
    s2, k2 = make(eng.cfg, "same prompt", 20)
    for s, _ in others:
        eng.submit(s)
    eng.submit(s2)
    await asyncio.gather(k2.done, *(k.done for _, k in others))
    assert k1.tokens == k2.tokens
    assert k1.tokens != others[0][1].tokens


async def test_planned_failure_stops_after_some_tokens(engine_factory):
    eng = engine_factory()
    s, k = make(eng.cfg, "fail me", 20, Failure(4, 500, "InternalServerError", "boom"))
    eng.submit(s)
    await asyncio.wait_for(k.done, 5)
    assert len(k.tokens) == 4 and k.error == (500, "InternalServerError", "boom")
    assert eng.kv.used == 0


async def test_failure_plan_is_seeded_and_covers_both_kinds(engine_factory):
    a = engine_factory(fail_rate=0.5, oom_rate=0.5, seed=11)
    b = engine_factory(fail_rate=0.5, oom_rate=0.5, seed=11)
    plan_a = [a.plan_failure(10) for _ in range(40)]
    plan_b = [b.plan_failure(10) for _ in range(40)]
    key = [(f.at, f.status, f.message) for f in plan_a]
    assert key == [(f.at, f.status, f.message) for f in plan_b]
    assert any(f.at == 0 for f in plan_a) and any(f.at > 0 for f in plan_a)
    assert any("CUDA out of memory" in f.message for f in plan_a)
    assert any("CUDA out of memory" not in f.message for f in plan_a)
    none = engine_factory()
    assert all(none.plan_failure(10) is None for _ in range(20))


async def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine_factory):
    eng = engine_factory()
    original = eng._schedule
    calls = []

    def broken_once(now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("simulated bug")
        return original(now)

    eng._schedule = broken_once
    s1, k1 = make(eng.cfg, "first", 5)
    eng.submit(s1)
    await asyncio.wait_for(k1.done, 5)
    assert k1.error is not None and k1.error[0] == 500
    s2, k2 = make(eng.cfg, "second", 5)
    eng.submit(s2)
    await asyncio.wait_for(k2.done, 5)
    assert len(k2.tokens) == 5 and k2.error is None
    assert eng.kv.used == 0


# -- vLLM's --scheduling-policy priority ------------------------------------------------------


async def test_priority_scheduling_runs_the_lowest_value_first_then_by_arrival(engine_factory):
    eng = engine_factory(max_num_seqs=1, time_scale=100.0, scheduling_policy="priority")
    run, krun = make(eng.cfg, "running", 50)
    eng.submit(run)
    queued = []
    for name, prio in (("late-low", 2), ("high", 0), ("normal", 1), ("high-2", 0)):
        seq, sink = make(eng.cfg, name, 3)
        seq.priority = prio
        eng.submit(seq)
        queued.append((name, sink))
    await asyncio.wait_for(asyncio.gather(krun.done, *(k.done for _, k in queued)), 20)
    order = [name for name, sink in sorted(queued, key=lambda x: x[1].times[0])]
    assert order == ["high", "high-2", "normal", "late-low"]


async def test_fcfs_ignores_priority(engine_factory):
    eng = engine_factory(max_num_seqs=1, time_scale=100.0)
    run, krun = make(eng.cfg, "running", 20)
    eng.submit(run)
    queued = []
    for name, prio in (("first", 2), ("second", 0)):
        seq, sink = make(eng.cfg, name, 3)
        seq.priority = prio
        eng.submit(seq)
        queued.append((name, sink))
    await asyncio.wait_for(asyncio.gather(krun.done, *(k.done for _, k in queued)), 20)
    assert queued[0][1].times[0] < queued[1][1].times[0]


@pytest.mark.parametrize("policy, victim", [("fcfs", "high"), ("priority", "low")])
async def test_a_cache_out_of_blocks_preempts_the_newest_or_by_priority_the_lowest(engine_factory, policy, victim):
    """Two sequences outgrow a cache of 10 blocks: fcfs preempts the newest (here the high
    one, admitted second), priority scheduling the lowest priority's (the low one, older)."""
    eng = engine_factory(num_gpu_blocks=10, max_model_len=160, time_scale=100.0, scheduling_policy=policy)
    low, klow = make(eng.cfg, "l" * 40, 140)
    low.priority = 5
    eng.submit(low)
    await asyncio.sleep(0.01)  # low runs first
    high, khigh = make(eng.cfg, "h" * 40, 140)
    eng.submit(high)
    await asyncio.wait_for(asyncio.gather(klow.done, khigh.done), 20)
    assert eng.metrics.preemptions >= 1
    assert [len(klow.tokens), len(khigh.tokens)] == [140, 140]
    # The preempted one finished last: it recomputed after the other had its blocks.
    last = "low" if klow.times[-1] > khigh.times[-1] else "high"
    assert last == victim, (klow.times[-1], khigh.times[-1])
