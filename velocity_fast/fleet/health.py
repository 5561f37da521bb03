"""Endpoint health: active checks and scrapes, passive ejection with backoff (docs/design.md, "Dispatch and the answer")."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Annotated, Callable

import msgspec

from .endpoint import Endpoint
from .scrape import MetricNames, pace_between, parse_engine_metrics

__all__ = ["HealthSettings", "EndpointMonitor"]

log = logging.getLogger("velocity.health")

# The span an engine's decode pace is measured over (its inter-token latency histogram
# differenced between readings this far apart, or more).
PACE_SPAN_S = 1.0


# A period or timeout in ms (docs/configuration.md, "Ranges"): at least 1 ms, so that no
# value spins a loop, and at most a day.
_Ms = Annotated[float, msgspec.Meta(ge=1, le=86_400_000)]


class _ModelEntry(msgspec.Struct):
    id: str = ""
    max_model_len: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] | None = None


class _ModelList(msgspec.Struct):
    data: list[_ModelEntry] = []


class HealthSettings(msgspec.Struct, forbid_unknown_fields=True):
    scrape_interval_ms: _Ms = 100.0  # engine /metrics
    scrape_timeout_ms: _Ms = 500.0  # a hanging scrape is abandoned; metrics go stale
    check_interval_ms: _Ms = 1000.0  # engine /health while healthy
    check_timeout_ms: _Ms = 1000.0
    eject_base_ms: _Ms = 500.0  # first ejection; doubles on each repeat
    eject_max_ms: _Ms = 30000.0
    eject_after_5xx: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 3  # consecutive engine 5xx before ejection
    metrics: MetricNames = msgspec.field(default_factory=MetricNames)


def _connect_error(e: OSError) -> str:
    """An engine connection's failure in a few words: the socket's own error (the upstream
    pool wraps it, so it is the context) rather than the wrapper's text."""
    for x in (e, e.__context__):
        if isinstance(x, OSError) and x.errno:
            return os.strerror(x.errno).lower()
        if isinstance(x, TimeoutError):
            return "no connection in time"
    return str(e) or type(e).__name__


class EndpointMonitor:
    """One task per endpoint: health checks, and scrapes while it is healthy."""

    def __init__(
        self,
        settings: HealthSettings,
        on_change: Callable[[Endpoint, str], None],
        on_metrics: Callable[[Endpoint], None],
    ) -> None:
        self.settings = settings
        self.on_change = on_change
        self.on_metrics = on_metrics
        self._tasks: dict[str, asyncio.Task] = {}
        # Per endpoint not checked yet, a future its first check's answer settles.
        self._first: dict[str, asyncio.Future] = {}
        # Per endpoint, the engine's prefix-cache counters at the last scrape (queries, hits).
        self.prefix_cache: dict[str, tuple[float, float]] = {}
        # Each engine's inter-token latency histogram (time, sum, count) and its running
        # gauge over the last PACE_SPAN_S: its decode pace, and the batch it decoded at.
        self._itl: dict[str, collections.deque] = {}
        # Endpoints whose /v1/models was asked since they last became healthy.
        self._asked_len: set[str] = set()
        # Per endpoint not healthy, why its last transition happened (shown in /stats).
        self.reasons: dict[str, str] = {}

    def watch(self, ep: Endpoint) -> None:
        if ep.name not in self._tasks:
            loop = asyncio.get_running_loop()
            if ep.state == "unknown":
                self._first[ep.name] = loop.create_future()
            self._tasks[ep.name] = loop.create_task(self._watch(ep))

    def unwatch(self, ep: Endpoint) -> None:
        self.prefix_cache.pop(ep.name, None)
        self.reasons.pop(ep.name, None)
        self._asked_len.discard(ep.name)
        self._settle(ep.name)
        t = self._tasks.pop(ep.name, None)
        if t is not None:
            t.cancel()

    async def first_checks(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until every endpoint watched has had its
        first health check answered (healthy or down). The gateway takes clients only
        then, so a request sent the moment it starts finds its engines checked, not a
        503 for engines that nobody has asked yet."""
        waiting = [f for f in self._first.values() if not f.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

    def _settle(self, name: str) -> None:
        f = self._first.pop(name, None)
        if f is not None and not f.done():
            f.set_result(None)

    async def stop(self) -> None:
        for name in list(self._first):
            self._settle(name)
        tasks = list(self._tasks.values())
        self._tasks.clear()
        # A cancel can be lost (a library call that swallows it as its own work completes):
        # cancel again until every monitor has ended, so that stopping never hangs.
        while tasks:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=0.5)
            tasks = [t for t in tasks if not t.done()]

    # -- state changes ------------------------------------------------------------------
    def _set(self, ep: Endpoint, state: str, why: str | None = None) -> None:
        """Move ``ep`` to ``state``: one log line per transition, with its reason."""
        if ep.state != state:
            old, ep.state = ep.state, state
            ep.healthy = state == "healthy"
            if not ep.healthy:  # a restarted engine may come back with another context
                self._asked_len.discard(ep.name)
            if ep.healthy:
                ep.up_since = time.monotonic()
                self.reasons.pop(ep.name, None)
            elif why:
                self.reasons[ep.name] = why
            level = logging.WARNING if state in ("ejected", "unserved") else logging.INFO
            if why:
                log.log(level, "endpoint %s: %s -> %s: %s", ep.name, old, state, why)
            else:
                log.log(level, "endpoint %s: %s -> %s", ep.name, old, state)
            self.on_change(ep, state)
        if state != "unknown":
            self._settle(ep.name)

    def checked_healthy(self, ep: Endpoint) -> None:
        """A check made outside this monitor passed (a reload asks a new engine before it
        goes into routing): the endpoint routes now, as after its own first check."""
        ep.failures = 0
        self._set(ep, "healthy")

    def eject(self, ep: Endpoint, why: str) -> None:
        s = self.settings
        ep.eject_backoff = (
            min(s.eject_max_ms, max(s.eject_base_ms, ep.eject_backoff * 2)) / 1000.0
            if ep.eject_backoff
            else s.eject_base_ms / 1000.0
        )
        ep.ejected_until = time.monotonic() + ep.eject_backoff
        self._set(ep, "ejected", f"{why}; checked again in {ep.eject_backoff:.1f}s")

    def passive_failure(self, ep: Endpoint, *, connect: bool) -> None:
        """A request saw a connect error (eject now) or an engine 5xx (eject after a few)."""
        ep.failures += 1
        if connect or ep.failures >= self.settings.eject_after_5xx:
            if ep.healthy:
                self.eject(ep, "connect error" if connect else f"{ep.failures} consecutive 5xx")

    @staticmethod
    def passive_success(ep: Endpoint) -> None:
        ep.failures = 0

    # -- the loop ----------------------------------------------------------------------------
    async def _check(self, ep: Endpoint) -> str | None:
        """None when the engine's /health answers 200; otherwise why not, in a few words."""
        timeout_ms = self.settings.check_timeout_ms
        try:
            status, _ = await ep.upstream.fetch("GET", "/health", timeout=timeout_ms / 1000)
        except asyncio.TimeoutError:
            return f"health check: no answer within {timeout_ms:g} ms"
        except OSError as e:
            return f"health check: {_connect_error(e)}"
        return None if status == 200 else f"health check: /health answered HTTP {status}"

    async def _learn_models(self, ep: Endpoint) -> str | None:
        """Ask the engine's /v1/models whether it serves the model this endpoint is
        configured for, and its max_model_len (vLLM and the sim engine give it per model),
        so that the gateway reports and enforces what the engine accepts. None: it serves
        the model, or it gave no list to tell; otherwise what to change."""
        self._asked_len.add(ep.name)
        headers = [("authorization", f"Bearer {ep.api_key}")] if ep.api_key else []
        try:
            status, body = await ep.upstream.fetch(
                "GET", "/v1/models", headers=headers, timeout=self.settings.check_timeout_ms / 1000
            )
            models = msgspec.json.decode(body, type=_ModelList).data if status == 200 else []
        except (OSError, asyncio.TimeoutError, msgspec.DecodeError) as e:
            log.debug("endpoint %s: no model list from /v1/models: %r", ep.name, e)
            return None
        served = [m.id for m in models if m.id]
        if served and ep.model not in served:
            # vLLM serves a model under its path or hub id unless --served-model-name says
            # otherwise: a name that differs is a common mistake, and every request would
            # get the engine's 404.
            return (
                f"model {ep.model!r} not served; the engine serves {', '.join(map(repr, served))}: set "
                f"this endpoint's model to one of them (--endpoint {ep.name}=URL=MODEL, or `model` of "
                f"endpoint {ep.name!r} in the config file), or start the engine with "
                f"--served-model-name {ep.model}"
            )
        lens = [m.max_model_len for m in models if m.max_model_len and m.id == ep.model] or [
            m.max_model_len for m in models if m.max_model_len
        ]
        if lens:
            ep.max_model_len = min(lens)
        return None

    async def _scrape(self, ep: Endpoint) -> None:
        # What the engine shows running beyond the most this gateway had in flight there
        # while the scrape was on its way is other gateways' work (saturation.pyx's
        # observe_endpoint): the window starts now, not at the scrape before, so that a
        # peak of ours long gone does not hide theirs.
        ep.inflight_peak = ep.inflight
        try:
            status, body = await ep.upstream.fetch("GET", "/metrics", timeout=self.settings.scrape_timeout_ms / 1000)
        except (OSError, asyncio.TimeoutError):
            return
        if status != 200:
            return
        m = parse_engine_metrics(body, self.settings.metrics)
        if not m.found:
            return
        ep.running, ep.waiting, ep.kv_usage = m.running, m.waiting, m.kv_usage
        if m.running > ep.max_running_seen:
            ep.max_running_seen = m.running
        if m.num_gpu_blocks:
            ep.num_gpu_blocks, ep.block_size = m.num_gpu_blocks, m.block_size
        if m.prefix_queries is not None:
            self.prefix_cache[ep.name] = (m.prefix_queries, m.prefix_hits)
        ep.decoded = -1.0
        if m.itl_count is not None:
            # Over the last second or more, not one scrape's interval: a step that holds a
            # long prefill makes one interval's tokens late together, and what a request's
            # deadline sees is the pace over its whole decode.
            t = time.monotonic()
            readings = self._itl.get(ep.name)
            if readings is None or (readings and readings[-1][2] > m.itl_count):  # new, or restarted
                readings = self._itl[ep.name] = collections.deque()
            while len(readings) > 1 and t - readings[1][0] >= PACE_SPAN_S:
                readings.popleft()
            old = readings[0] if readings and t - readings[0][0] >= PACE_SPAN_S else None
            # Tokens decoded since the last scrape: whether a step ran (saturation's proof
            # of a batch ceiling, admission/saturation.pyx).
            ep.decoded = m.itl_count - readings[-1][2] if readings else -1.0
            ep.pace = pace_between(None if old is None else old[1:3], (m.itl_sum, m.itl_count))
            # The batch it decoded at over that span: the most running at any reading in it.
            ep.pace_batch = max(m.running, max((r[3] for r in readings), default=0.0))
            readings.append((t, m.itl_sum, m.itl_count, m.running))
        ep.scraped_at = time.monotonic()
        self.on_metrics(ep)

    async def _watch(self, ep: Endpoint) -> None:
        s = self.settings
        next_check = 0.0
        while True:
            try:
                now = time.monotonic()
                if ep.state == "ejected" and now < ep.ejected_until:
                    await asyncio.sleep(min(ep.ejected_until - now, s.check_interval_ms / 1000))
                    continue
                if now >= next_check or not ep.healthy:
                    why = await self._check(ep)
                    next_check = time.monotonic() + s.check_interval_ms / 1000
                    if why is None:
                        ep.failures = 0
                        if not ep.healthy:
                            # Routed only once it is known to serve its model (or cannot say).
                            unserved = await self._learn_models(ep)
                            if unserved is not None:
                                self._set(ep, "unserved", unserved)
                                await asyncio.sleep(s.check_interval_ms / 1000)
                                continue
                            self._set(ep, "healthy")
                        elif ep.eject_backoff and time.monotonic() - ep.up_since > 30.0:
                            ep.eject_backoff = 0.0  # stable again: the next ejection starts short
                    elif ep.healthy or ep.state == "ejected":
                        self.eject(ep, why)
                    elif ep.state in ("unknown", "unserved"):
                        self._set(ep, "down", why)
                        await asyncio.sleep(s.eject_base_ms / 1000)
                        continue
                    else:
                        await asyncio.sleep(s.eject_base_ms / 1000)
                        continue
                if ep.healthy:
                    if ep.name not in self._asked_len:  # made healthy by a check of its own (a reload's)
                        unserved = await self._learn_models(ep)
                        if unserved is not None:
                            self._set(ep, "unserved", unserved)
                            continue
                    await self._scrape(ep)
                await asyncio.sleep(s.scrape_interval_ms / 1000)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one endpoint's monitor die silently
                log.exception("monitor of endpoint %s failed; retrying", ep.name)
                await asyncio.sleep(1.0)
