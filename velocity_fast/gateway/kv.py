"""The gateway's KV event side: one subscriber per endpoint that names an events address,
one shared block index, the token side of precise pools, their metrics
(docs/kv-events.md, "Precise routing in the gateway").

    kv = KVFleet(registry, endpoints_fn)
    kv.add(cfg); kv.start()                   # subscribers run from start() on
    precise = kv.precise_for(routing_settings)   # None unless some pool is precise
    kv.on_change(ep, state)                   # the health monitor's word
    kv.remove(name); kv.stop()
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Any, Callable

from velocity_fast.config import EndpointConfig, KVEventsConfig
from velocity_fast.fleet.endpoint import Endpoint
from velocity_fast.kvevents.index import BlockIndex
from velocity_fast.kvevents.subscriber import Subscriber
from velocity_fast.metrics.registry import MAX, Registry
from velocity_fast.routing.precise.scoring import PrecisePrefix
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["KVFleet", "kv_events_for_engines"]

log = logging.getLogger("velocity.kv")


class KVFleet:
    """Subscribers, the block index and the precise token side of one gateway."""

    def __init__(
        self,
        registry: Registry,
        endpoints: Callable[[], dict[str, Endpoint]],
        prefix_cache: Callable[[], dict[str, tuple[float, float]]] | None = None,
    ) -> None:
        self.index = BlockIndex()
        self._endpoints = endpoints
        self._configs: dict[str, KVEventsConfig] = {}
        self._subs: dict[str, Subscriber] = {}
        self._running = False
        self.precise: PrecisePrefix | None = None
        self._precise_key: tuple | None = None
        self._registry = registry
        self._down: set[str] = set()
        stat = self._stat
        reg = registry
        # Every worker subscribes to the same engines' streams and reads the same scrapes: one whole each.
        reg.gauge_fn(
            "velocity_kv_events_received",
            "KV cache events applied from the endpoint's engine since the gateway subscribed.",
            lambda: stat("events"),
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_kv_events_lost",
            "Event batches missing from the endpoint's stream (sequence gaps), recovered or not.",
            lambda: stat("lost"),
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_kv_events_unrecovered",
            "Gaps the replay endpoint could not fill (each made the endpoint's index approximate).",
            lambda: stat("unrecovered"),
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_kv_index_resyncs",
            "Times the endpoint's index became exact again after being approximate.",
            lambda: stat("resyncs"),
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_kv_index_blocks",
            "Blocks the endpoint's engine holds, by its KV events.",
            lambda: [((k,), self.index.size(k)) for k in self._subs],
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_kv_index_exact",
            "1 while the endpoint's index is exact (precise routing uses it), else 0.",
            lambda: [((k,), float(self.index.exact(k))) for k in self._subs],
            ("endpoint",),
            merge=MAX,
        )
        pc = prefix_cache or dict
        reg.gauge_fn(
            "velocity_endpoint_prefix_cache_queries",
            "The engine's prefix-cache queries in tokens (its vllm:prefix_cache_queries counter, last scrape).",
            lambda: [((k,), q) for k, (q, _) in pc().items()],
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_endpoint_prefix_cache_hits",
            "The engine's prefix-cache hits in tokens (its vllm:prefix_cache_hits counter, last scrape).",
            lambda: [((k,), h) for k, (_, h) in pc().items()],
            ("endpoint",),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_endpoint_prefix_cache_hit_ratio",
            "The engine's prefix-cache hits / queries since it started (last scrape).",
            lambda: [((k,), h / q if q else 0.0) for k, (q, h) in pc().items()],
            ("endpoint",),
            merge=MAX,
        )

    def _stat(self, field: str) -> list:
        return [((k,), getattr(self.index.stats(k), field)) for k in self._subs]

    # -- endpoints ------------------------------------------------------------------------
    def add(self, cfg: EndpointConfig) -> None:
        if cfg.kv_events is None:
            return
        self._configs[cfg.name] = cfg.kv_events
        if self._running:
            self._start_one(cfg.name)

    def _start_one(self, name: str) -> None:
        c = self._configs[name]
        self.index.remove(name)  # a fresh subscription starts from nothing known
        self._subs[name] = Subscriber(self.index, name, c.endpoint, c.replay_endpoint, topic=c.topic).start()

    def remove(self, name: str) -> None:
        self._configs.pop(name, None)
        self._down.discard(name)
        sub = self._subs.pop(name, None)
        if sub is not None:
            sub.stop()
        self.index.remove(name)

    def start(self) -> None:
        self._running = True
        for name in self._configs:
            if name not in self._subs:
                self._start_one(name)

    def stop(self) -> None:
        self._running = False
        for sub in self._subs.values():
            sub.stop()
        self._subs.clear()
        if self.precise is not None:
            self.precise.close()
            self.precise = None

    def on_change(self, ep: Endpoint, state: str) -> None:
        """An endpoint left routing or came back: its engine may have restarted (an empty
        cache) without the event stream showing it, so its entries are rebuilt from the
        engine's replay buffer (approximate until they can be)."""
        sub = self._subs.get(ep.name)
        if sub is None:
            return
        if state != "healthy":
            if ep.name not in self._down:
                self._down.add(ep.name)
                sub.resync()
        elif ep.name in self._down:
            self._down.discard(ep.name)
            sub.resync()

    def stats(self) -> dict:
        out = {k: {**self.index.stats(k).as_dict(), "blocks": self.index.size(k)} for k in self._subs}
        return {"endpoints": out, "precise": self.precise.stats() if self.precise is not None else None}

    # -- the precise token side -------------------------------------------------------------------
    def block_size(self, model: str) -> int:
        """The block size of a pool's engines: from their events, else their scrape."""
        fallback = 0
        for ep in list(self._endpoints().values()):
            if ep.model != model:
                continue
            bs = self.index.block_size(ep.name)
            if bs:
                return bs
            if ep.block_size and not fallback:
                fallback = int(ep.block_size)
        return fallback

    def precise_for(self, rs: RoutingSettings) -> PrecisePrefix | None:
        """The token side for these routing settings: kept while what it reads is the same,
        else made anew (the old one's thread ends)."""
        key = (
            rs.prefix,
            tuple(sorted(rs.prefix_modes.items())),
            rs.tokenizer,
            tuple(sorted(rs.tokenizers.items())),
            rs.token_cache_entries,
            rs.hotspot_gap,
            rs.load_weight,
        )
        if key == self._precise_key and self.precise is not None:
            self.precise.settings = rs  # what the key leaves out (free_cache_weight) is read live
            return self.precise
        new = (
            PrecisePrefix(rs, self.index, registry=self._registry, block_size=self.block_size)
            if rs.precise_models()
            else None
        )
        if self.precise is not None:
            self.precise.close()
        self.precise, self._precise_key = new, key
        return new


def kv_events_for_engines(plan: Any, rs: RoutingSettings, sock_dir: str) -> tuple[Any, list[EndpointConfig]]:
    """The engines chargeVelocity starts, with vLLM's --kv-events-config where their pool
    is precise (and the sim's --tokenizer), and their endpoint configs with the events
    addresses filled in. The sockets are ipc:// files in ``sock_dir``: local to the
    machine, as the engines' HTTP ports are, and no port to race for."""
    specs, eps = [], []
    for spec in plan.specs:
        kv = None
        if rs.prefix_for(spec.model_name) == "precise":
            pub = f"ipc://{os.path.join(sock_dir, spec.name + '.kv')}"
            replay = f"ipc://{os.path.join(sock_dir, spec.name + '.replay')}"
            conf = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": pub,
                "replay_endpoint": replay,
                "topic": "kv",
            }
            argv = tuple(spec.argv) + ("--kv-events-config", json.dumps(conf, separators=(",", ":")))
            tok = rs.tokenizer_for(spec.model_name)
            if plan.kind == "sim" and tok and "--tokenizer" not in argv:
                argv += ("--tokenizer", tok)
            kv = KVEventsConfig(endpoint=pub, replay_endpoint=replay, topic="kv")
            spec = replace(spec, argv=argv)
        specs.append(spec)
        eps.append(EndpointConfig(name=spec.name, url=spec.url, model=spec.model_name, kv_events=kv))
    return replace(plan, specs=tuple(specs)), eps
