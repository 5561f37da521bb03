"""The sim engine's scheduler: continuous batching over a KV-block pool.

One step loop per engine, as vLLM's engine core: each step admits waiting sequences
(FIFO, while a batch slot and the prompt's KV blocks are free; the head of the queue
blocks the rest), gives every decoding sequence one token, and spends the rest of the
step's token budget on prefill. The step takes (1/decode_tps) * (1 + contention *
(batch - 1)) plus the prefill tokens / prefill_tps, divided by the time scale.

Tokens go to each sequence's sink synchronously (no task per token) and are written
before the loop sleeps, which keeps the engine cheap enough to feed every later test
and benchmark.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Protocol

from .kvcache import Allocation, KVCache
from .metrics import SimMetrics
from .settings import SimConfig
from .tokens import VOCAB_BITS

log = logging.getLogger("velocity.sim")

WAITING, RUNNING, DONE = 0, 1, 2

#: A step loop that falls behind by more than this (real seconds) stops catching up,
#: so a stall (GC, a busy CPU) is not followed by a burst of instant steps.
_MAX_LAG = 0.05

#: Output is written before every sleep of the step loop, so it costs no latency.
#: A loop that has no time to sleep (a high time scale, a busy CPU) is behind its
#: schedule anyway; it writes every _FLUSH_STEPS steps (or _MAX_LAG seconds), so
#: several tokens share one write per stream: the socket write is most of the cost of
#: a token, and sharing it lets the loop catch up.
_FLUSH_STEPS = 8

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 1.06 GiB is free. (simulated)"
)
FAIL_MESSAGE = "The engine failed while running the request. (simulated)"
OVERLOAD_MESSAGE = "The engine is temporarily unable to serve the request. (simulated)"


class Sink(Protocol):
    """Where a sequence's output goes (a streamed or a whole response)."""

    def token(self, tok: int, finish_reason: str | None) -> bool:
        """One generated token; finish_reason is set on the last one. True when the
        sink has output waiting for flush()."""

    def fail(self, status: int, type: str, message: str) -> bool:
        """The engine failed the sequence after it started (same return as token)."""

    def flush(self) -> None:
        """Write the output collected since the last flush."""

    def aborted(self) -> None:
        """The sequence was aborted (the client went away)."""


class Publisher(Protocol):
    """Where KV events go (``kvevents.ZmqPublisher``)."""

    def publish(self, events: list) -> None:
        """Send one batch of events."""


class Failure:
    """A planned failure: before the response (``at == 0``) or at output token ``at``."""

    __slots__ = ("at", "status", "type", "message")

    def __init__(self, at: int, status: int, type: str, message: str) -> None:
        self.at = at
        self.status = status
        self.type = type
        self.message = message


def _rank(seq: "Sequence") -> tuple[int, float]:
    """A sequence's place under priority scheduling: lower priority values first, then
    earlier arrivals (vLLM's Request ordering); the preemption victim is the largest."""
    return seq.priority, seq.arrival


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "prompt_tokens",
        "hashes",
        "target",
        "finish_reason",
        "rng",
        "sink",
        "failure",
        "state",
        "generated",
        "num_tokens",
        "prefill_left",
        "alloc",
        "arrival",
        "scheduled",
        "first_token",
        "last_token",
        "cached_tokens",
        "token_ids",
        "keep",
        "external",
        "priority",
    )

    def __init__(
        self,
        prompt_tokens: int,
        hashes: list[int],
        target: int,
        finish_reason: str,
        rng: random.Random,
        sink: Sink,
        failure: Failure | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.hashes = hashes
        self.token_ids = token_ids  # the prompt's token ids, kept only for KV events
        self.target = target  # output tokens to generate
        self.finish_reason = finish_reason  # "length" (max_tokens reached) or "stop"
        self.rng = rng
        self.sink = sink
        self.failure = failure
        self.state = WAITING
        self.generated = 0
        self.num_tokens = prompt_tokens  # prompt + generated: what the KV must hold
        self.prefill_left = 0
        self.alloc: Allocation | None = None
        self.arrival = 0.0
        self.scheduled = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.cached_tokens = 0  # prompt tokens served by the prefix cache
        # Disaggregation (sim/pd.py): a prefill's keep(seq) takes its blocks when the reply
        # ends at its max tokens; a decode's prompt tokens pulled from a prefill engine.
        self.keep: Callable[[Sequence], None] | None = None
        self.external = 0
        self.priority = 0  # the body's priority (lower runs first under priority scheduling)


class Engine:
    """Continuous batching with KV accounting; start() runs the step loop."""

    def __init__(self, cfg: SimConfig, metrics: SimMetrics | None = None, publisher: Publisher | None = None) -> None:
        self.cfg = cfg
        self._by_priority = cfg.scheduling_policy == "priority"
        lru = cfg.num_gpu_blocks if cfg.prefix_cache_blocks is None else cfg.prefix_cache_blocks
        self.kv = KVCache(cfg.num_gpu_blocks, cfg.block_size, lru, cfg.enable_prefix_caching)
        # KV events (--kv-events-config): the cache collects them, _flush publishes them.
        self.publisher = publisher
        if publisher is not None:
            self.kv.events = []
        self.metrics = metrics if metrics is not None else SimMetrics(cfg)
        self.metrics.bind(self)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self.max_running_seen = 0
        self._fail_rng = random.Random(cfg.seed)
        self._wake: asyncio.Future | None = None
        self._dirty: list[Sink] = []  # sinks with output waiting for _flush()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._step_base = 1.0 / cfg.decode_tps / cfg.time_scale
        self._prefill_cost = 1.0 / cfg.prefill_tps / cfg.time_scale

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="sim-engine-steps")

    async def stop(self) -> None:
        """Stop the step loop and abort whatever is left."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._flush()
        for seq in list(self.running) + list(self.waiting):
            self.abort(seq)
        self._publish_events()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix (vLLM's ``/reset_prefix_cache``). With running
        sequences it fails, unless ``reset_running_requests``: then they are preempted
        first and recompute their prompts, as vLLM does."""
        if reset_running_requests:
            for seq in list(self.running):
                self._preempt(seq)
        ok = self.kv.reset()
        self._publish_events()
        return ok

    # -- requests --------------------------------------------------------------
    def plan_failure(self, target: int) -> Failure | None:
        """Draw whether the next request fails (--fail-rate, --oom-rate) and where.

        Drawn from the engine's own seeded generator, so a retried request is not doomed
        to fail again, while a run with the same seed and order fails the same way.
        """
        cfg = self.cfg
        if not (cfg.fail_rate or cfg.oom_rate):
            return None
        r = self._fail_rng.random()
        if r >= cfg.fail_rate + cfg.oom_rate:
            return None
        oom = r >= cfg.fail_rate
        # Half the failures come before any response byte, half after some tokens.
        at = 0 if self._fail_rng.random() < 0.5 or target < 2 else self._fail_rng.randint(1, target - 1)
        if oom:
            return Failure(at, 500, "InternalServerError", OOM_MESSAGE)
        if at == 0 and self._fail_rng.random() < 0.5:
            return Failure(0, 503, "ServiceUnavailableError", OVERLOAD_MESSAGE)
        return Failure(at, 500, "InternalServerError", FAIL_MESSAGE)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; it runs when a batch slot and its KV blocks are free."""
        loop = self._loop or asyncio.get_running_loop()
        seq.arrival = loop.time()
        seq.state = WAITING
        if self._by_priority:
            self._wait_in_order(seq)
        else:
            self.waiting.append(seq)
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence (client gone) and free its blocks at once."""
        if seq.state == DONE:
            return
        if seq.state == WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        else:
            self.running.remove(seq)
            self.kv.release(seq.alloc)
            self._publish_events()
        seq.state = DONE
        self.metrics.finished(seq, "abort", self._now())
        seq.sink.aborted()

    # -- the step loop ---------------------------------------------------------
    def _now(self) -> float:
        return (self._loop or asyncio.get_running_loop()).time()

    async def _run(self) -> None:
        # A bug in a step must not leave every client hanging: fail what is in the
        # engine with a 500, log once, and keep serving.
        while True:
            try:
                await self._steps()
            except Exception:
                log.exception("sim engine step failed; failing the requests in flight")
                for seq in list(self.running) + list(self.waiting):
                    if seq.alloc is not None and seq.state == RUNNING:
                        self.kv.release(seq.alloc)
                    seq.state = DONE
                    if seq.sink.fail(500, "InternalServerError", "The engine step failed."):
                        self._dirty.append(seq.sink)
                self.running = []
                self.waiting.clear()
                self._flush()

    async def _steps(self) -> None:
        loop = self._loop
        sleep = asyncio.sleep
        deadline = loop.time()
        last_flush = deadline
        unflushed = 0
        while True:
            if not self.running and not self.waiting:
                self._flush()
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
                deadline = loop.time()
            dt, emitting = self._schedule(loop.time())
            if dt is None:
                # Waiting work that cannot be admitted with nothing running cannot
                # happen (one sequence always fits); guard against a busy loop anyway.
                self._flush()
                await sleep(self._step_base)
                continue
            deadline += dt
            now = loop.time()
            if deadline > now:
                self._flush()
                last_flush, unflushed = now, 0
                await sleep(deadline - now)
            else:
                if now - deadline > _MAX_LAG:
                    deadline = now
                unflushed += 1
                if unflushed >= _FLUSH_STEPS or now - last_flush >= _MAX_LAG:
                    self._flush()
                    last_flush, unflushed = now, 0
                await sleep(0)
            self._emit(emitting, loop.time())
            self.steps += 1

    def _publish_events(self) -> None:
        # One batch per loop pass with anything to say (vLLM: one per scheduler step).
        ev = self.kv.events
        if ev:
            self.kv.events = []
            self.publisher.publish(ev)

    def _flush(self) -> None:
        if self.kv.events:
            self._publish_events()
        dirty = self._dirty
        if dirty:
            self._dirty = []
            for sink in dirty:
                sink.flush()

    def _schedule(self, now: float) -> tuple[float | None, list[Sequence]]:
        """Admit waiting sequences and plan one step; returns its duration and the
        sequences that get a token at its end."""
        cfg = self.cfg
        kv = self.kv
        running = self.running
        waiting = self.waiting
        # Admission: FIFO while a slot and the prompt's blocks are free; the head of the
        # queue waits for blocks even if a later, smaller request would fit.
        while waiting and len(running) < cfg.max_num_seqs:
            seq = waiting[0]
            got = kv.allocate_prompt(seq.hashes, seq.num_tokens, 1, seq.token_ids)
            if got is None:
                break
            waiting.popleft()
            seq.alloc, hit = got
            if seq.external > hit:  # pulled from a prefill engine: only the last token is computed
                hit = seq.external
            seq.prefill_left = seq.num_tokens - hit
            if seq.scheduled == 0.0:
                seq.scheduled = now
                seq.cached_tokens = hit
                self.metrics.scheduled(seq, now)
            seq.state = RUNNING
            running.append(seq)
        if not running:
            return None, []
        if len(running) > self.max_running_seen:
            self.max_running_seen = len(running)
        budget = cfg.max_num_batched_tokens
        emitting: list[Sequence] = []
        prefill_tokens = 0
        batch = 0
        i = 0
        while i < len(running):
            seq = running[i]
            if seq.prefill_left == 0:
                # A decoding sequence needs room for the token this step computes.
                need = kv.blocks_for(seq.num_tokens + 1) - seq.alloc.num_blocks
                if need > 0 and not kv.grow(seq.alloc, need):
                    # Out of blocks: preempt the newest running sequence (vLLM's
                    # recompute preemption; by priority, the lowest priority's latest)
                    # and try again.
                    victim = max(running, key=_rank) if self._by_priority else running[-1]
                    if running.index(victim) < i:
                        # Already planned into this step: it emits nothing (the step
                        # keeps the length planned with it).
                        i -= 1
                        if victim in emitting:
                            emitting.remove(victim)
                    self._preempt(victim)
                    continue
                emitting.append(seq)
                budget -= 1
                batch += 1
            elif budget > 0:
                take = seq.prefill_left if seq.prefill_left < budget else budget
                seq.prefill_left -= take
                budget -= take
                prefill_tokens += take
                batch += 1
                if seq.prefill_left == 0:
                    emitting.append(seq)
            i += 1
        if not batch:
            return None, []
        dt = self._step_base * (1.0 + cfg.batch_contention * (batch - 1)) + prefill_tokens * self._prefill_cost
        return dt, emitting

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.alloc)
        seq.alloc = None
        seq.prefill_left = 0
        seq.state = WAITING
        if self._by_priority:
            self._wait_in_order(seq)  # by its priority and first arrival
        else:
            self.waiting.appendleft(seq)
        self.metrics.preempted()

    def _wait_in_order(self, seq: Sequence) -> None:
        """Queue ``seq`` at its place by (priority, arrival), as vLLM's priority queue."""
        waiting = self.waiting
        key = _rank(seq)
        i = len(waiting)
        while i > 0 and _rank(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, seq)

    def _emit(self, emitting: list[Sequence], now: float) -> None:
        bits = VOCAB_BITS
        m = self.metrics
        itl = m.itl_observe
        dirty = self._dirty
        finished = False
        n = 0
        for seq in emitting:
            if seq.state != RUNNING:  # aborted or preempted while the step ran
                continue
            n += 1
            seq.generated += 1
            seq.num_tokens += 1
            if seq.generated == 1:
                seq.first_token = now
                m.first_token(seq, now)
            else:
                itl(now - seq.last_token)
            seq.last_token = now
            tok = seq.rng.getrandbits(bits)
            f = seq.failure
            if f is not None and seq.generated > f.at:
                seq.state = DONE
                finished = True
                m.finished(seq, "error", now)
                if seq.sink.fail(f.status, f.type, f.message):
                    dirty.append(seq.sink)
                continue
            if seq.generated >= seq.target:
                seq.state = DONE
                finished = True
                m.finished(seq, seq.finish_reason, now)
                if seq.sink.token(tok, seq.finish_reason):
                    dirty.append(seq.sink)
            elif seq.sink.token(tok, None):
                dirty.append(seq.sink)
        m.generation_tokens += n
        if finished:
            keep = []
            for seq in self.running:
                if seq.state == DONE:
                    if seq.keep is not None and seq.generated >= seq.target and seq.finish_reason == "length":
                        seq.keep(seq)  # held for a decode engine to pull (sim/pd.py)
                    else:
                        self.kv.release(seq.alloc)
                else:
                    keep.append(seq)
            self.running = keep
