"""The gateway: the routes of the client and admin ports (docs/design.md, "Arrival"), and the proxy path
client -> api -> admission -> router -> upstream -> completion."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time

from velocity_fast.admission.controller import STATS_WHOLE as ADMISSION_WHOLE
from velocity_fast.admission.errors import retry_headers
from velocity_fast.config import EndpointConfig, Settings
from velocity_fast.fleet.endpoint import STATS_WHOLE as ENDPOINT_WHOLE
from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.fleet.health import EndpointMonitor
from velocity_fast.gateway.assemble import build_admission, build_router, routing_settings
from velocity_fast.gateway.errors import BadRequest, ListenError
from velocity_fast.gateway.identity import Identity
from velocity_fast.gateway.ingress import Ingress, band_for, handle_client
from velocity_fast.gateway.kv import KVFleet
from velocity_fast.gateway.observability import GatewayMetrics
from velocity_fast.gateway.pd import configure_pools
from velocity_fast.gateway.routes import GENERATION_ROUTES, MODEL_PREFIX, RELAY_ROUTES, OtherRoutes
from velocity_fast.http.message import Request
from velocity_fast.metrics.registry import Registry
from velocity_fast.server.connection import Responder
from velocity_fast.server.http_server import HTTPServer
from velocity_fast.server.limits import ServerLimits
from velocity_fast.upstream.pool import UpstreamPool

POOL_SPARE = 2  # connections past max_concurrency an endpoint's pool keeps: a health check, a scrape

__all__ = ["Gateway"]

# The client port's paths, as velocity_requests_total's route label (any other: "other", as
# ingress.pyx counts an internal error's route).
_GENERATION = frozenset(GENERATION_ROUTES)
_CLIENT_ROUTES = frozenset(
    (
        "/v1/chat/completions",
        "/v1/completions",
        "/generate",
        "/v1/models",
        "/stats",
        "/v1/models/{id}",
        *GENERATION_ROUTES,
        *RELAY_ROUTES,
    )
)

log = logging.getLogger("velocity.gateway")

# /stats's own numbers that every worker reports whole (its uptime; a tenant's settings,
# shared bucket and fairness counter; the engines' KV event streams, which every worker
# reads), with those its parts declare: several workers' /stats take the largest of them
# (gateway/stats_merge.py), and sum the rest.
STATS_WHOLE = (
    frozenset(
        {
            "uptime_seconds",
            "kv_events",
            "weight",
            "requests_per_second",
            "tokens_per_minute",
            "quota_tokens_left",
            "counter",
            "pending",
            "lifted",
            "min_uncached_tokens",
            "max_prefill_tokens_in_flight",
        }
    )
    | ENDPOINT_WHOLE
    | ADMISSION_WHOLE
)


def _ingress_field(name: str) -> property:
    """A field the request path reads as C: kept in the gateway's Ingress (gateway/ingress.pyx)."""
    return property(
        lambda self: getattr(self.ingress, name),
        lambda self, v: setattr(self.ingress, name, v),
        doc=f"The Ingress's {name} (read by the request path as C).",
    )


class Gateway:
    """One gateway process: client server, admin server, endpoint monitors, admission, router.

    Its identity, router, admission, monitor, metrics, pools, default model, band names
    and loop live in its ``Ingress`` (compiled, gateway/ingress.pyx), where the request
    path reads them as C; the Ingress calls back into this object for the rest
    (``health``, ``route_other``, ``reject``, ``sla_for``)."""

    identity = _ingress_field("identity")
    router = _ingress_field("router")
    admission = _ingress_field("admission")
    monitor = _ingress_field("monitor")
    metrics = _ingress_field("metrics")
    pools = _ingress_field("pools")
    default_model = _ingress_field("default_model")
    band_names = _ingress_field("band_names")
    default_band = _ingress_field("default_band")

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        # What the request path reads of the settings, as a C field of the Ingress (a
        # reload sets the settings, so it follows).
        self._settings = settings
        self.ingress.max_model_len = settings.max_model_len

    loop = _ingress_field("loop")

    def __init__(self, settings: Settings, *, backend: str = "endpoints", model_label: str | None = None) -> None:
        self.ingress = Ingress()
        self.other = OtherRoutes(self)  # vLLM's routes beyond chat (gateway/routes.py)
        self.ingress.app = self
        # The client port's handler (compiled): /health, the key check, the proxy routes;
        # every other route goes to route_other below.
        self.handle = functools.partial(handle_client, self.ingress)
        self.settings = settings
        # What it started with: a reload replaces `settings`, but the keys read once at
        # start (reload.RESTART_KEYS) keep these values until the next start.
        self.started_settings = settings
        self.backend = backend
        self.registry = Registry()
        # Tenant buckets shared with the other replicas (state/store.py); redis is imported
        # only when configured. Where each bucket lives is chosen here, once.
        self.state_store = None
        if settings.state_store:
            from velocity_fast.state.store import StateStore

            self.state_store = StateStore(settings.state_store, self.registry)
        self.identity = Identity(settings, self.state_store)
        if self.state_store is not None:
            self.state_store.attach(self.identity)
        self.endpoints: dict[str, Endpoint] = {}
        self.pools: dict[str, Pool] = {}
        self.default_model: str | None = None
        self.model_label = model_label
        self.started_at = time.monotonic()
        self.metrics = GatewayMetrics(self.registry, self)
        self.monitor = EndpointMonitor(settings.health, self._on_endpoint_change, self._on_metrics)
        self.admission = build_admission(settings, self.pools, self.registry)
        # KV events of the endpoints that publish them; the token side of precise pools.
        self.kv = KVFleet(self.registry, lambda: self.endpoints, lambda: self.monitor.prefix_cache)
        self.router = build_router(settings, self.registry, precise=self.kv.precise_for(routing_settings(settings)))
        # OpenTelemetry only when tracing is on: its packages are imported only then.
        self.tracing = None
        if settings.tracing.sample_ratio > 0:
            from velocity_fast.gateway.tracing import Tracing

            self.tracing = self.ingress.tracing = Tracing(settings.tracing)
        self.band_names = [b.name for b in settings.bands]
        self.default_band = self.resolve_default_band()
        self.client_server: HTTPServer | None = None
        self.watching = False  # health monitors run: endpoints added from now on are watched at once
        self.admin_server: HTTPServer | None = None
        self.draining = False  # stop() began: /ready answers 503, the client port is closed
        self.loop: asyncio.AbstractEventLoop | None = None
        for cfg in settings.endpoints:
            self.add_endpoint(cfg, watch=False)

    # -- endpoints ---------------------------------------------------------------------
    def add_endpoint(self, cfg: EndpointConfig, *, watch: bool = True) -> Endpoint:
        if cfg.name in self.endpoints:
            raise ValueError(f"endpoint {cfg.name!r} exists")
        ep = Endpoint(
            cfg.name, cfg.url, cfg.model, api_key=cfg.api_key, limit=self.settings.max_concurrency, role=cfg.role
        )
        # Idle connections past what the endpoint can have in flight (its concurrency limit,
        # a health check and a scrape) would never all be used: the pool keeps no more.
        ep.upstream = UpstreamPool(
            cfg.url,
            max_idle=self.settings.max_concurrency + POOL_SPARE,
            connect_timeout=self.settings.server.upstream_connect_timeout_s,
        )
        self.endpoints[ep.name] = ep
        pool = self.pools.get(ep.model)
        if pool is None:
            pool = self.pools[ep.model] = Pool(ep.model)
        pool.endpoints.append(ep)
        configure_pools(self.pools, self.settings)
        if self.default_model is None:
            self.default_model = ep.model
        self.kv.add(cfg)
        if watch:
            self.monitor.watch(ep)
        return ep

    def remove_endpoint(self, name: str, *, close: bool = True) -> Endpoint | None:
        """Take an endpoint out of routing. ``close=False`` leaves its connections to the
        caller, so that requests in flight on it can finish (live reload)."""
        ep = self.endpoints.pop(name, None)
        if ep is None:
            return None
        self.monitor.unwatch(ep)
        self.kv.remove(name)
        pool = self.pools[ep.model]
        pool.endpoints.remove(ep)
        configure_pools(self.pools, self.settings)
        if not pool.endpoints:
            del self.pools[ep.model]
            if self.default_model == ep.model:
                self.default_model = next(iter(self.pools), None)
        if close:
            ep.upstream.close()
        return ep

    def reload(self, settings: Settings) -> tuple[list[str], list]:
        """Take over a new, validated configuration live; see gateway/reload.py."""
        from .reload import apply_settings

        return apply_settings(self, settings)

    def set_endpoint_available(self, name: str, available: bool) -> None:
        """An engine supervisor's word: a restarting engine leaves routing at once."""
        ep = self.endpoints.get(name)
        if ep is None:
            return
        if not available:
            self.router.forget(name)  # a restarted engine starts with an empty prefix cache
            self.kv.on_change(ep, "restarting")
            if ep.healthy:
                self.monitor.eject(ep, "engine restarting")

    def _on_endpoint_change(self, ep: Endpoint, state: str) -> None:
        self.kv.on_change(ep, state)
        self.admission.on_metrics(ep)  # an endpoint back in routing may take queued work at once

    def _on_metrics(self, ep: Endpoint) -> None:
        self.admission.on_metrics(ep)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(
        self,
        host: str | None = None,
        port: int | None = None,
        admin_port: int | None = None,
        *,
        admin_host: str | None = None,
        reuse_port: bool = False,
    ) -> None:
        """Listen (host, ports: the settings' unless given; ``admin_host``: the admin
        port's own address, a worker's loopback; ``reuse_port``: the client port is shared
        with the other workers of a supervisor, gateway/workers.py)."""
        s = self.settings
        self.loop = asyncio.get_running_loop()
        limits = ServerLimits(
            max_body_bytes=s.server.max_body_bytes,
            max_header_bytes=s.server.max_header_bytes,
            header_timeout=s.server.header_timeout_s,
            body_timeout=s.server.body_timeout_s,
            keepalive_timeout=s.server.keepalive_timeout_s,
            first_byte_timeout=s.server.first_byte_timeout_s,
        )
        host = s.host if host is None else host
        self.admin_server = HTTPServer(self.handle_admin, limits=limits, name="admin")
        admin_host = host if admin_host is None else admin_host
        admin_port = s.admin_port if admin_port is None else admin_port
        try:
            await self.admin_server.start(admin_host, admin_port)
        except OSError as e:
            self.admin_server = None
            raise ListenError("admin_port", admin_host, admin_port, e) from None
        self.watching = True
        for ep in self.endpoints.values():
            self.monitor.watch(ep)
        self.kv.start()
        if self.state_store is not None:  # the first leases before the first client (at most 0.5 s)
            await self.state_store.start()
        # Clients only once each engine has answered its first health check (or the
        # check timed out), as a proxy warms a cluster before its listener: a request
        # sent the moment the gateway is up must not meet engines nobody has asked yet.
        await self.monitor.first_checks(s.health.check_timeout_ms / 1000 + 0.25)
        server = HTTPServer(self.handle, limits=limits, name="gateway", on_error=self.ingress.answer_internal_error)
        server.cut_message = "The gateway shut down before the response was complete."
        port = s.port if port is None else port
        try:
            await server.start(host, port, reuse_port=reuse_port)
        except OSError as e:
            await self.stop(grace=0)
            raise ListenError("port", host, port, e) from None
        self.client_server = server  # /ready says so only from here on
        log.info(
            "gateway on %s:%d, admin on %s:%d, policy %s, %d endpoint(s)",
            host,
            self.client_server.port,
            self.admin_server.host,
            self.admin_server.port,
            s.policy,
            len(self.endpoints),
        )

    @property
    def port(self) -> int:
        return self.client_server.port if self.client_server else 0

    @property
    def admin_port(self) -> int:
        return self.admin_server.port if self.admin_server else 0

    async def stop(self, grace: float | None = None) -> None:
        """The drain (SIGTERM): the client port stops accepting at once and /ready answers
        503, as a load balancer expects; requests in flight get ``grace`` seconds to finish,
        then what still runs is ended for its client (HTTPServer.shutdown: a 503, or a
        stream's error event and [DONE]). The admin port closes last."""
        grace = self.settings.server.shutdown_grace_s if grace is None else grace
        self.draining = True
        if self.client_server is not None:
            log.info(
                "shutting down: %d request(s) in flight, grace %g s; new connections refused, /ready 503",
                self.client_server.requests,
                grace,
            )
            await self.client_server.shutdown(grace)
        if self.admin_server is not None:
            await self.admin_server.shutdown(grace)
        self.admission.close()
        await self.monitor.stop()
        self.kv.stop()
        if self.state_store is not None:
            await self.state_store.close()
        for ep in self.endpoints.values():
            ep.upstream.close()
        if self.tracing is not None:  # the spans still queued, exported (bounded wait)
            self.ingress.tracing = None
            await self.tracing.close()

    # -- client port -----------------------------------------------------------------------------

    def route_other(self, req: Request, resp: Responder):
        """The client port's routes other than /health and the proxy routes (already
        authenticated): answers at once or returns a coroutine the server runs as a task."""
        path = req.path
        if path == "/v1/models" and req.method == "GET":
            self.count_answer(path, 200)
            return self._models(resp)
        if path == "/stats" and req.method == "GET":
            self.count_answer(path, 200)
            return resp.send_json(200, self.stats())
        # vLLM's other routes (gateway/routes.py): one look-up each, off chat's path.
        if path in _GENERATION:
            return self.other.generate(req, resp)
        relay = RELAY_ROUTES.get(path)
        if relay is not None:
            return self.other.relay(req, resp, *relay)
        if path.startswith(MODEL_PREFIX) and req.method == "GET":
            return self.other.model(req, resp)
        self.count_answer(path, 404)
        return resp.send_error(404, f"No route for {req.method} {path}. Routes: {', '.join(self.other.routes())}.")

    def count_answer(self, path: str, status: int) -> None:
        """velocity_requests_total for a client-port answer outside the proxy's books (a
        401, a 404 or 405, /v1/models, /stats), band "-": a path the gateway does not serve
        counts as route "other", so that a scanner's paths add no series."""
        self.metrics.requests.labels(path if path in _CLIENT_ROUTES else "other", status, "-").inc()

    def refuse_key(self, port: str, path: str | None = None) -> None:
        """Books of a 401 (``port``: client or admin); a client-port one is also a request."""
        self.metrics.auth_failures.labels(port).inc()
        if path is not None:
            self.count_answer(path, 401)

    def health(self, resp: Responder) -> None:
        healthy = any(e.healthy for e in self.endpoints.values())
        resp.send_json(
            200,
            {
                "status": "ok" if healthy else "degraded",
                "policy": self.settings.policy,
                "backend": self.backend,
                "model": self.model_label or self.default_model,
                "uptime_seconds": round(time.monotonic() - self.started_at, 3),
                "healthy_endpoints": sum(e.healthy for e in self.endpoints.values()),
                "endpoints": len(self.endpoints),
            },
        )

    def _models(self, resp: Responder) -> None:
        data = [self.model_object(model, pool) for model, pool in self.pools.items() if pool.healthy()]
        resp.send_json(200, {"object": "list", "data": data})

    def model_object(self, model: str, pool: Pool) -> dict:
        """One model of /v1/models (and GET /v1/models/{id}), in OpenAI's model shape."""
        return {
            "id": model,
            "object": "model",
            "created": int(self.started_at_wall),
            "owned_by": "velocityllm",
            "root": model,
            "parent": None,
            "max_model_len": pool.context_length(self.settings.max_model_len),
        }

    @property
    def started_at_wall(self) -> float:
        return time.time() - (time.monotonic() - self.started_at)

    # -- the proxy path ----------------------------------------------------------------------------
    def reject(
        self,
        resp: Responder,
        route: str,
        status: int,
        reason: str,
        message: str,
        band: str,
        headers: list,
        retry_after: float | None = None,
        from_admission: bool = False,
    ) -> None:
        hdrs = list(headers)
        hdrs.append(("x-velocity-reject-reason", reason))
        if retry_after is not None:
            hdrs.extend(retry_headers(retry_after))
        if not from_admission:  # admission counts its own
            self.admission.telemetry.reject(reason)
        self.metrics.requests.labels(route, status, band).inc()
        resp.send_error(status, message, headers=hdrs)

    def _band_for(self, raw, tenant) -> str:
        """The band a request asks for (header, then body), capped by its tenant's max_band."""
        return band_for(self.band_names, raw, tenant, self.default_band)

    def resolve_default_band(self) -> str | None:
        """The band of a request that names none: admission.default_band (validated against
        the bands; None leaves band_for its own rule)."""
        band = self.admission.settings.default_band
        return band if band in self.band_names else None

    def sla_for(self, header: str | None, body_value: float | None) -> float | None:
        """The SLA the client asked for; None leaves it to the tenant's, else the server's
        (admission's ``sla_ms``), which is enforced the same way."""
        if header is not None:
            try:
                v = float(header)
            except ValueError:
                raise BadRequest(
                    f"x-velocity-sla-ms must be a number of milliseconds, got {header!r}.", "sla_ms"
                ) from None
            if not 0 < v < math.inf:  # nan and inf are numbers to float(), not SLAs
                raise BadRequest("x-velocity-sla-ms must be a positive, finite number of milliseconds.", "sla_ms")
            return v
        return body_value

    # -- admin port ----------------------------------------------------------------------------------------
    async def handle_admin(self, req: Request, resp: Responder) -> None:
        path = req.path
        if path == "/health":
            return self.health(resp)
        if self.identity.required:  # /metrics too (every path but /health); scrapers send the key
            ok, _ = self.identity.authenticate(req.headers)
            if not ok:
                self.refuse_key("admin")
                return resp.send_error(401, "Missing or invalid API key.", type="AuthenticationError")
        if req.method != "GET":
            return resp.send_error(405, f"Use GET for {path}.")
        if path == "/metrics":
            # "?merge": a worker asked by its supervisor (gateway/workers.py) says how each family merges.
            return resp.send(
                200,
                self.registry.render(merge_rules=req.query == "merge"),
                content_type="text/plain; version=0.0.4; charset=utf-8",
            )
        if path == "/ready":
            # Ready: an engine to send to, and the client port open (the engines' first
            # checks come before it, and one engine may pass while another is asked); not
            # once the drain began.
            n = sum(e.healthy for e in self.endpoints.values())
            ready = bool(n) and self.client_server is not None and not self.draining
            return resp.send_json(
                200 if ready else 503, {"ready": ready, "healthy_endpoints": n, "draining": self.draining}
            )
        if path == "/stats":
            if req.query == "merge":  # a worker asked by its supervisor: which numbers are whole
                return resp.send_json(200, {**self.stats(), "merge": {"largest": sorted(STATS_WHOLE)}})
            return resp.send_json(200, self.stats())
        return resp.send_error(404, f"No route for {req.method} {path}.")

    def stats(self) -> dict:
        return {
            "policy": self.settings.policy,
            "uptime_seconds": round(time.monotonic() - self.started_at, 3),
            "endpoints": [
                {
                    **e.snapshot(),
                    "reason": None if e.healthy else self.monitor.reasons.get(e.name),
                    "connections": e.upstream.stats() if e.upstream is not None else None,
                }
                for e in self.endpoints.values()
            ],
            "pools": {m: [e.name for e in p.endpoints] for m, p in self.pools.items()},
            # The pools that serve disaggregated: their decider's threshold and counts.
            "pd": {m: p.pd.snapshot() for m, p in self.pools.items() if p.pd is not None},
            "admission": self.admission.stats(),
            "routing": self.router.stats(),
            "kv_events": self.kv.stats(),
            "tenants": self.tenant_stats(),
        }

    def tenant_stats(self) -> dict:
        """Per tenant: the tokens the engines served it (prompt, cached, completion, from
        their usage) and that service as the fairness counter charges it, divided by the
        weight (``service``); its quota left, its requests declined by reason, and per band
        its fairness counter (of it: what answers in flight are charged, ``pending``, and
        what lifts added, ``lifted``) and queue depth. Every configured tenant is listed,
        and any other that has a counter in a band (it was queued or charged there)."""
        out: dict = {}
        adm = self.admission
        for name, t in self.identity.tenants.items():
            left = t.tokens_left()
            service = (
                t.served_prompt
                - t.served_cached
                + t.served_cached * adm.settings.fairness_cached_weight
                + t.served_completion * adm.settings.fairness_output_weight
            ) / t.weight
            out[name] = {
                "weight": t.weight,
                "tokens": {"prompt": t.served_prompt, "cached": t.served_cached, "completion": t.served_completion},
                "service": round(service, 3),
                "requests_per_second": t.rate,
                "tokens_per_minute": t.tpm,
                "quota_tokens_left": None if left is None else round(left, 1),
                "rejections": dict(t.rejections),
                "bands": {},
            }
        names = self.admission.band_names
        for ps in self.admission.known_pools().values():
            for i, tenants in enumerate(ps.queues.tenant_snapshot()):
                for name, (counter, queued, pending, lifted) in tenants.items():
                    entry = out.get(name)
                    if entry is None:
                        entry = out[name] = {"bands": {}}
                    band = entry["bands"].setdefault(
                        names[i], {"counter": 0.0, "pending": 0.0, "lifted": 0.0, "queued": 0}
                    )
                    band["counter"] = round(max(band["counter"], counter), 3)
                    band["pending"] = round(max(band["pending"], pending), 3)
                    band["lifted"] = round(max(band["lifted"], lifted), 3)
                    band["queued"] += queued
        return out
