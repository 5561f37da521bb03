"""EngineSupervisor: start the planned engines, watch them, restart crashes, stop them all.

States reported through ``on_state_change(name, state)``: ``starting`` (launched, not yet
answering ``/health``), ``ready`` (``/health`` answered 200: route to it), ``crashed``
(exited or never became ready: keep it out of routing; a restart follows after a backoff
that doubles up to a ceiling) and ``stopped``.

An engine that fails during :meth:`EngineSupervisor.start` is an error (with the tail of
its log), not a restart loop: a wrong flag or a model that does not fit should be seen at
once. Every child is stopped by :meth:`stop`, by the async context manager's exit, by an
``atexit`` hook if the loop died without stopping, and (Linux) by the kernel's parent
death signal if the gateway is killed outright (see process.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from velocity_fast.engines.errors import EngineStartError
from velocity_fast.engines.plan import ENGINE_HOST, EngineSpec

from ..harness.procs import stop_all
from .probe import http_status
from .process import read_tail, signal_group, spawn, wait_exit

log = logging.getLogger("velocity_fast.engines")

STARTING = "starting"
READY = "ready"
CRASHED = "crashed"
STOPPED = "stopped"

StateCallback = Callable[[str, str], None]


def describe_exit(code: int) -> str:
    """Say how a child ended, naming the signal for a negative Popen return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _Engine:
    __slots__ = ("first", "offset", "proc", "ready_at", "restarts", "spec", "state", "task")

    def __init__(self, spec: EngineSpec, first: asyncio.Future[None]) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.offset = 0
        self.state = STOPPED
        self.restarts = 0
        self.task: asyncio.Task[None] | None = None
        self.first = first  # resolved at the first ready, or failed at the first failure
        self.ready_at = 0.0


class EngineSupervisor:
    """Run a list of EngineSpecs as supervised child processes.

    ``ready_timeout``: seconds an engine may take to answer /health 200 (vLLM loads the
    weights and compiles first: minutes). ``backoff_initial``/``backoff_max``: the restart
    delays after a crash; the delay returns to the initial value once an engine stayed
    ready for ``backoff_reset_after`` seconds. ``stop_grace``: seconds between SIGTERM
    and SIGKILL. ``death_signal``: sent by the kernel to a child whose parent died.
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        *,
        on_state_change: StateCallback | None = None,
        ready_timeout: float = 1800.0,
        poll_interval: float = 0.25,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        backoff_reset_after: float = 60.0,
        stop_grace: float = 20.0,
        log_tail_lines: int = 40,
        death_signal: int | None = signal.SIGTERM,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique: {names}")
        self.specs = tuple(specs)
        self._on_state_change = on_state_change
        self.ready_timeout = ready_timeout
        self.poll_interval = poll_interval
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.backoff_reset_after = backoff_reset_after
        self.stop_grace = stop_grace
        self.log_tail_lines = log_tail_lines
        self.death_signal = death_signal
        self._engines: dict[str, _Engine] = {}
        self._stopping = False
        self._started = False
        self._atexit_registered = False

    # ---- public face -------------------------------------------------------------

    def endpoints(self) -> list[tuple[str, str, str]]:
        """(name, url, served model) of every engine, whatever its state."""
        return [(s.name, s.url, s.model_name) for s in self.specs]

    def states(self) -> dict[str, str]:
        """The current state of every engine by name."""
        return {s.name: (self._engines[s.name].state if s.name in self._engines else STOPPED) for s in self.specs}

    def pids(self) -> dict[str, int]:
        """The process id of every engine whose process is running now."""
        return {n: e.proc.pid for n, e in self._engines.items() if e.proc is not None and e.proc.returncode is None}

    def restarts(self) -> dict[str, int]:
        """How many times each engine was restarted after a crash."""
        return {n: e.restarts for n, e in self._engines.items()}

    async def start(self) -> None:
        """Start every engine and return once all answer /health 200.

        Raises EngineStartError (with the log tail) when one exits or times out first;
        every engine is stopped before the error propagates (also on cancellation).
        """
        if self._started:
            raise RuntimeError("EngineSupervisor.start() called twice")
        self._started = True
        loop = asyncio.get_running_loop()
        if not self._atexit_registered:
            atexit.register(self.kill_now)
            self._atexit_registered = True
        try:
            for spec in self.specs:
                engine = _Engine(spec, loop.create_future())
                self._engines[spec.name] = engine
                engine.task = loop.create_task(self._run(engine), name=f"engine-{spec.name}")
            firsts = [e.first for e in self._engines.values()]
            done, _ = await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                raise failed[0]
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every engine: SIGTERM to each process group, SIGKILL after the grace."""
        self._stopping = True
        tasks = [e.task for e in self._engines.values() if e.task is not None and not e.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        live = [e for e in self._engines.values() if e.proc is not None and e.proc.returncode is None]
        for e in live:
            signal_group(e.proc, signal.SIGTERM)  # type: ignore[arg-type]
        if live:
            waits = [asyncio.ensure_future(wait_exit(e.proc)) for e in live]  # type: ignore[arg-type]
            _, pending = await asyncio.wait(waits, timeout=self.stop_grace)
            for e in live:
                # Also the leader's leftovers: children that ignored SIGTERM keep the group.
                signal_group(e.proc, signal.SIGKILL)  # type: ignore[arg-type]
            if pending:
                log.warning("engines did not stop within %.1fs; killed", self.stop_grace)
                await asyncio.wait(pending)
        for e in self._engines.values():
            if not e.first.done():
                e.first.set_exception(
                    EngineStartError(e.spec.name, "stopped before it was ready", str(e.spec.log_path), "")
                )
            if not e.first.cancelled():
                e.first.exception()  # mark retrieved: no "exception was never retrieved" noise
            self._set_state(e, STOPPED)
        if self._atexit_registered:
            atexit.unregister(self.kill_now)
            self._atexit_registered = False

    def kill_now(self, grace: float = 3.0) -> None:
        """Synchronous last resort (atexit, fatal errors): SIGTERM all groups, then SIGKILL."""
        procs = [e.proc for e in self._engines.values() if e.proc is not None and e.proc.poll() is None]
        stop_all(procs, grace, whole=True, sweep=True, kill_grace=1.0, group=True)

    async def __aenter__(self) -> EngineSupervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- the per-engine loop -----------------------------------------------------

    def _set_state(self, e: _Engine, state: str) -> None:
        if e.state == state:
            return
        e.state = state
        log.info("engine %s: %s", e.spec.name, state)
        if self._on_state_change is not None:
            try:
                self._on_state_change(e.spec.name, state)
            except Exception:  # a faulty listener must not stop supervision
                log.exception("on_state_change(%s, %s) failed", e.spec.name, state)

    async def _run(self, e: _Engine) -> None:
        delay = self.backoff_initial
        while not self._stopping:
            self._set_state(e, STARTING)
            failure = await self._attempt(e)
            if self._stopping:
                return
            if e.proc is not None:
                # What the dead leader forked may still hold the port or the GPU.
                signal_group(e.proc, signal.SIGKILL)
            if e.ready_at and time.monotonic() - e.ready_at >= self.backoff_reset_after:
                delay = self.backoff_initial
            tail = await asyncio.to_thread(read_tail, e.spec.log_path, e.offset, self.log_tail_lines)
            self._set_state(e, CRASHED)
            if not e.first.done():
                e.first.set_exception(EngineStartError(e.spec.name, failure, str(e.spec.log_path), tail))
                return
            log.warning(
                "engine %s crashed (%s); restart in %.1fs; last lines of %s:\n%s",
                e.spec.name,
                failure,
                delay,
                e.spec.log_path,
                tail,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)
            e.restarts += 1

    async def _attempt(self, e: _Engine) -> str:
        """Run one life of the engine; return why it ended."""
        spec = e.spec
        e.ready_at = 0.0
        try:
            e.proc, e.offset = spawn(spec.argv, spec.env, spec.log_path, death_signal=self.death_signal)
        except OSError as exc:
            e.proc = None
            return f"cannot run {spec.argv[0]}: {exc}"
        exited = asyncio.ensure_future(wait_exit(e.proc))
        try:
            deadline = time.monotonic() + self.ready_timeout
            while not exited.done():
                if time.monotonic() >= deadline:
                    signal_group(e.proc, signal.SIGKILL)
                    await exited
                    return f"no /health 200 within {self.ready_timeout:.0f}s"
                status = await http_status(ENGINE_HOST, spec.port, timeout=max(self.poll_interval, 1.0))
                if status == 200:
                    break
                await asyncio.wait([exited], timeout=self.poll_interval)
            if exited.done():
                return f"{describe_exit(exited.result())} before answering /health"
            e.ready_at = time.monotonic()
            self._set_state(e, READY)
            if not e.first.done():
                e.first.set_result(None)
            return describe_exit(await exited)
        finally:
            if not exited.done():
                exited.cancel()
