"""Live reload: SIGHUP re-reads the configuration and the running gateway takes it over.

What changes live: bands and their ceilings, capacities and TTLs; tenants, their keys,
rate limits and weights; the global API key; endpoints added, removed or changed; the
admission section, thresholds, SLA and policy; routing profiles and settings. What needs a
restart (said in a warning): the listening address and ports, server limits, health
timings, the log settings and tracing.

How a new configuration takes over without losing a request:
- The file is read and validated in full (in a thread) before anything changes, so a
  refused file changes nothing; the swap itself is synchronous on the event loop, so a
  request sees either the old configuration or the new one.
- A request reads ``gateway.admission`` when it arrives. A lease already granted keeps
  its own controller and releases into it; the old controller's queue keeps dispatching
  on its own timer and releases until it is empty, then it is closed. Both controllers
  count in-flight work on the same Endpoint objects, so neither oversubscribes an engine.
- A removed endpoint leaves routing at once; its connections are closed only when its
  last in-flight request finished (or after the shutdown grace).
- An added or changed endpoint is asked for its ``/health`` before the swap (at most
  ``health.check_timeout_ms``); one that answered goes into routing healthy, so a pool
  whose endpoints were all replaced, or a new model, serves at once rather than
  answering 503 until the first routine check.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable

import msgspec

from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.gateway.assemble import build_admission, build_router, routing_settings
from velocity_fast.gateway.identity import Identity
from velocity_fast.gateway.pd import configure_pools
from velocity_fast.upstream.pool import UpstreamPool

from ..config import ConfigError, Settings

__all__ = ["Reloader", "apply_settings", "changed_keys", "RESTART_KEYS"]

log = logging.getLogger("velocity.reload")

# Keys that are read once at start: a change is reported, and applies at the next start.
RESTART_KEYS = (
    "host",
    "port",
    "admin_port",
    "server",
    "health",
    "sim",
    "model_path",
    "engine",
    "vllm_python",
    "structured_logs",
    "log_level",
    "state_store",
    "workers",
    "tracing",
)

_DRAIN_POLL_S = 0.2


class _AdoptingRegistry:
    """A view of the gateway's registry for a rebuilt Router: a metric registered again
    is the one already there (counters stay monotonic, scrape gauges read the new object)."""

    def __init__(self, registry: Any) -> None:
        self._reg = registry

    def _adopt(self, kind: str, name: str, *args: Any, **kw: Any) -> Any:
        got = self._reg.get(name)
        return got if got is not None else getattr(self._reg, kind)(name, *args, **kw)

    def counter(self, name: str, *args: Any, **kw: Any) -> Any:
        return self._adopt("counter", name, *args, **kw)

    def gauge(self, name: str, *args: Any, **kw: Any) -> Any:
        return self._adopt("gauge", name, *args, **kw)

    def histogram(self, name: str, *args: Any, **kw: Any) -> Any:
        return self._adopt("histogram", name, *args, **kw)

    def gauge_fn(self, name: str, help: str, fn: Callable, labelnames: Any = (), *, merge: str | None = None) -> None:
        got = self._reg.get(name)
        if got is None:
            self._reg.gauge_fn(name, help, fn, labelnames, merge=merge)
        else:
            got.fn = fn

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._reg, attr)


def _identity(old: Identity, settings: Settings, store=None) -> Identity:
    """A new Identity that keeps the state of tenants that stay: an unchanged tenant is the
    same object; a changed one keeps its figures and the buckets whose limits did not change
    (``store``: the state store its buckets live in, if any)."""
    new = Identity(settings, store)
    for name, t in list(new.tenants.items()):
        prev = old.tenants.get(name)
        if prev is None:
            continue
        if (prev.max_band, prev.weight, prev.rate, prev.burst, prev.sla_ms, prev.tpm) == (
            t.max_band,
            t.weight,
            t.rate,
            t.burst,
            t.sla_ms,
            t.tpm,
        ):
            new.tenants[name] = prev
            for key, bound in list(new.by_key.items()):
                if bound is t:
                    new.by_key[key] = prev
        else:
            t.keep_state(prev)
    return new


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The configuration keys whose values differ, as dotted paths the way an operator
    reads them: ``tenants.alice.sla_ms``, ``server.max_body_bytes``; an entry of a named
    list (tenants, bands, endpoints) or of a mapping added or removed is ``tenants.carol
    added``. Names of keys only: a value may be a secret (a tenant's api_key)."""
    if old == new:
        return []
    if isinstance(old, msgspec.Struct) and type(old) is type(new):
        out: list[str] = []
        for f in old.__struct_fields__:
            out += changed_keys(getattr(old, f), getattr(new, f), f"{prefix}.{f}" if prefix else f)
        return out
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{k}"
            if k not in old:
                out.append(f"{path} added")
            elif k not in new:
                out.append(f"{path} removed")
            else:
                out += changed_keys(old[k], new[k], path)
        return out
    if isinstance(old, list) and isinstance(new, list) and all(hasattr(x, "name") for x in old + new):
        before, after = {x.name: x for x in old}, {x.name: x for x in new}
        if len(before) == len(old) and len(after) == len(new):
            out = []
            for name in list(before) + [n for n in after if n not in before]:
                path = f"{prefix}.{name}"
                if name not in after:
                    out.append(f"{path} removed")
                elif name not in before:
                    out.append(f"{path} added")
                else:
                    out += changed_keys(before[name], after[name], path)
            if not out or [x.name for x in old if x.name in after] != [x.name for x in new if x.name in before]:
                out.append(f"{prefix} order")  # the bands' order is their priority
            return out
    return [prefix]


def _weights(settings: Settings) -> dict[str, float]:
    return {t.name: t.weight for t in settings.tenants}


def _endpoint_diff(old: Settings, new: Settings) -> tuple[list, list]:
    """(names to remove, configs to add); a changed endpoint is both."""
    before = {e.name: e for e in old.endpoints}
    after = {e.name: e for e in new.endpoints}
    remove = [n for n, e in before.items() if after.get(n) != e]
    add = [e for n, e in after.items() if before.get(n) != e]
    return remove, add


def apply_settings(gw: Any, new: Settings) -> tuple[list[str], list]:
    """Make ``new`` (already validated) the gateway's configuration.

    Returns (a list of what changed in words, the admission controllers and endpoints
    that must drain before they are closed). The router and identity, which can refuse
    settings, are built before anything is swapped.
    """
    old: Settings = gw.settings
    changes: list[str] = []
    retired: list = []

    rebuild = (
        new.policy != old.policy
        or AdmissionSettings.from_settings(new) != AdmissionSettings.from_settings(old)
        or _weights(new) != _weights(old)
    )  # the queues keep tenants' weights
    router = None
    if routing_settings(new) != routing_settings(old):
        kv = getattr(gw, "kv", None)
        router = build_router(
            new,
            _AdoptingRegistry(gw.registry),
            precise=kv.precise_for(routing_settings(new)) if kv is not None else None,
        )
    identity = None
    if new.api_key != old.api_key or new.tenants != old.tenants:
        identity = _identity(gw.identity, new, getattr(gw, "state_store", None))
    remove, add = _endpoint_diff(old, new)

    # -- the swap: synchronous, so no request sees half of it -----------------------------
    gw.settings = new
    # What the file changed that applies now, by key (endpoints are said below, one line
    # each; the keys read only at start are warned about at the end).
    live = [
        k
        for k in changed_keys(old, new)
        if k.split(".", 1)[0].split(" ", 1)[0] not in RESTART_KEYS and not k.startswith("endpoints")
    ]
    if live:
        changes.append("changed " + ", ".join(live))
    if identity is not None:
        store = getattr(gw, "state_store", None)
        if store is not None:  # before the swap: the store serves the new tenants' buckets
            store.attach(identity)
        gw.identity = identity
    if new.bands != old.bands:
        gw.band_names = [b.name for b in new.bands]
    if router is not None:
        gw.router = router
        changes.append("router rebuilt")
    started = gw.watching
    pools_before = {m: id(p) for m, p in gw.pools.items()}
    # Added before removed, so that a pool whose endpoints are all replaced stays the same
    # Pool object; a changed endpoint (same name) must leave first.
    added = {c.name for c in add}
    for cfg in add:
        if cfg.name in gw.endpoints:
            _retire_endpoint(gw, cfg.name, retired, changes)
        gw.add_endpoint(cfg, watch=started)
        changes.append(f"endpoint {cfg.name} added ({cfg.url}, model {cfg.model})")
    for name in remove:
        if name not in added:
            _retire_endpoint(gw, name, retired, changes)
    # A controller keeps state per Pool object: a pool that came or went needs a fresh one.
    # Built last, over the final pools; Settings.validate() already accepted its settings.
    if rebuild or {m: id(p) for m, p in gw.pools.items()} != pools_before:
        retired.append(gw.admission)
        gw.admission = build_admission(new, gw.pools, gw.registry)
        changes.append(f"admission rebuilt (policy {new.policy})")
    if new.pd != old.pd:  # the pools' deciders take the new threshold and timeout
        configure_pools(gw.pools, new)
    gw.default_band = gw.resolve_default_band()  # admission.default_band over the bands now in force
    # Compared with the values the gateway runs with (those it started with), not with the
    # last file read: a key set back to its running value is no change to report.
    running = getattr(gw, "started_settings", old)
    waiting = []
    for key in RESTART_KEYS:
        for path in changed_keys(getattr(running, key), getattr(new, key), key):
            log.warning(
                "config reload: %s; it takes effect at the next start",
                path if path.endswith((" added", " removed")) else f"{path} changed",
            )
            waiting.append(path)
    if waiting:  # a change the gateway read is not "no changes", though none applies yet
        changes.append(f"{', '.join(waiting)} at the next start")
    return changes, retired


def _retire_endpoint(gw: Any, name: str, retired: list, changes: list[str]) -> None:
    ep = gw.remove_endpoint(name, close=False)
    if ep is not None:
        gw.router.forget(name)
        retired.append(ep)
        changes.append(f"endpoint {name} removed")


class Reloader:
    """SIGHUP → read the configuration in a thread → apply it on the loop.

    ``load`` returns validated Settings or raises ConfigError (flags keep their
    precedence over the file because ``load`` applies them again).
    """

    def __init__(self, gw: Any, load: Callable[[], Settings]) -> None:
        self.gw = gw
        self.load = load
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._again = False
        self._draining: list = []
        self._drain_task: asyncio.Task | None = None
        self.reloads = 0
        self.refused = 0

    @property
    def draining(self) -> int:
        """Retired admission controllers and endpoints still finishing their requests."""
        return len(self._draining)

    def install(self) -> None:
        """Handle SIGHUP on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGHUP, self.request)

    def request(self) -> None:
        """Reload soon; signals that arrive during a reload coalesce into one more."""
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self._again = False
            await self.reload()
            if not self._again:
                return

    async def reload(self) -> bool:
        """Read and apply the configuration; False (and one log line) when it is refused."""
        try:
            settings = await asyncio.to_thread(self.load)
        except ConfigError as e:
            self.refused += 1
            log.error("config reload refused, the running configuration stays in force: %s", e)
            return False
        ready = await self._precheck(settings)
        try:
            changes, retired = self.gw.reload(settings)
        except Exception as e:  # a bug, not a config problem: keep serving on what runs
            self.refused += 1
            log.exception("config reload failed, the running configuration stays in force: %s", e)
            return False
        monitor = getattr(self.gw, "monitor", None)
        for name in ready:
            ep = self.gw.endpoints.get(name)
            if monitor is not None and ep is not None and ep.state == "unknown":
                monitor.checked_healthy(ep)
        self.reloads += 1
        log.info("config reloaded: %s", "; ".join(changes) if changes else "no changes")
        if retired:
            self._draining.extend(retired)
            if self._drain_task is None or self._drain_task.done():
                self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return True

    async def _precheck(self, settings: Settings) -> list[str]:
        """The added or changed endpoints whose engine answers ``/health`` with 200 now
        (asked together, each for at most the check timeout)."""
        _, add = _endpoint_diff(self.gw.settings, settings)
        if not add:
            return []
        timeout = self.gw.settings.health.check_timeout_ms / 1000  # health: not live

        async def ask(cfg) -> bool:
            pool = UpstreamPool(
                cfg.url, connect_timeout=min(timeout, self.gw.settings.server.upstream_connect_timeout_s)
            )
            try:
                status, _ = await pool.fetch("GET", "/health", timeout=timeout)
                return status == 200
            except Exception as e:  # down, slow, or not speaking HTTP: its own checks decide later
                log.debug("config reload: endpoint %s did not answer /health: %r", cfg.name, e)
                return False
            finally:
                pool.close()

        answers = await asyncio.gather(*(ask(cfg) for cfg in add))
        return [cfg.name for cfg, ok in zip(add, answers) if ok]

    async def _drain(self) -> None:
        """Close retired controllers and endpoint connections once nothing uses them."""
        grace = self.gw.settings.server.shutdown_grace_s
        loop = asyncio.get_running_loop()
        started = {id(x): loop.time() for x in self._draining}
        while self._draining:
            await asyncio.sleep(_DRAIN_POLL_S)
            now = loop.time()
            for x in list(self._draining):
                started.setdefault(id(x), now)
                if _idle(x) or (not hasattr(x, "admit") and now - started[id(x)] > grace):
                    _close(x)
                    self._draining.remove(x)

    def close(self) -> None:
        """Stop handling SIGHUP and close whatever still drains (at shutdown)."""
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGHUP)
            self._loop = None
        for task in (self._task, self._drain_task):
            if task is not None and not task.done():
                task.cancel()
        for x in self._draining:
            _close(x)
        self._draining.clear()


def _idle(x: Any) -> bool:
    if hasattr(x, "admit"):  # an Admission: nothing queued and no lease outstanding
        st = x.stats()
        return st["queued"] == 0 and st["counters"]["in_flight"] == 0
    return x.inflight == 0  # an Endpoint


def _close(x: Any) -> None:
    if hasattr(x, "admit"):
        x.close()
    else:
        x.upstream.close()
