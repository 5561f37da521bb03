"""Plays a workload against a server: open-loop arrivals, bounded concurrency.

Requests leave at their scheduled arrival times; when ``concurrency`` requests are
already in flight, the next one waits in the client (that wait is reported as
``client_wait_ms``, so a too-small ``--concurrency`` cannot hide as server latency).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .client import Client, Result, frozen_heap
from .workload import RequestSpec


@dataclass(slots=True)
class Progress:
    """Counters a progress display may read while the run goes on."""

    total: int
    sent: int = 0
    done: int = 0
    ok: int = 0


@dataclass(slots=True)
class RunOutcome:
    """The results (parallel to the specs), the run start and the client's CPU time."""

    results: list[Result]
    start: float
    cpu_seconds: float


async def run_workload(
    specs: list[RequestSpec],
    host: str,
    port: int,
    *,
    concurrency: int,
    timeout: float = 300.0,
    progress: Progress | None = None,
) -> RunOutcome:
    """Send every request of ``specs`` and return when all have answered or failed."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    progress = progress or Progress(total=len(specs))
    client = Client(host, port, timeout=timeout)
    sem = asyncio.Semaphore(concurrency)
    results: list[Result | None] = [None] * len(specs)
    loop = asyncio.get_running_loop()

    async def one(spec: RequestSpec) -> None:
        try:
            r = await client.send(spec.index, spec.wire)
            results[spec.index] = r
            progress.done += 1
            progress.ok += r.ok
        finally:
            sem.release()

    cpu0 = time.process_time()
    start = time.perf_counter()
    tasks = []
    try:
        with frozen_heap():
            for spec in specs:
                delay = start + spec.at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await sem.acquire()
                progress.sent += 1
                tasks.append(loop.create_task(one(spec)))
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        client.close()
    cpu = time.process_time() - cpu0
    return RunOutcome(results=results, start=start, cpu_seconds=cpu)
