"""The gateway's own metrics (docs/design.md, "Where each contract lives") and its log format."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING

from velocity_fast.metrics.registry import MAX, SUM, Registry

if TYPE_CHECKING:  # pragma: no cover
    from .app import Gateway

__all__ = ["GatewayMetrics", "setup_logging"]


class GatewayMetrics:
    """Per-request counters; per-endpoint values are read at scrape time.

    Admission registers the lease counters, rejections, queue, saturation, limit,
    in-flight, TTFT and latency metrics itself (admission/telemetry.pyx)."""

    def __init__(self, reg: Registry, gw: "Gateway") -> None:
        self.requests = reg.counter(
            "velocity_requests_total",
            "Requests answered, by route, status and band.",
            ("route", "status", "band"),
            merge=SUM,
        )
        self.auth_failures = reg.counter(
            "velocity_auth_failures_total",
            "Requests refused 401 for a missing or invalid key, by port.",
            ("port",),
            merge=SUM,
        )
        for port in ("client", "admin"):
            self.auth_failures.labels(port)  # at 0 from the start: a rate alert sees the first one
        self.internal_errors = reg.counter(
            "velocity_internal_errors_total",
            "Failures inside the gateway (answered 500), by route.",
            ("route",),
            merge=SUM,
        )
        for route in ("/v1/chat/completions", "/v1/completions", "/generate"):
            self.internal_errors.labels(route)  # at 0 from the start: a rate alert sees the first one
        self.upstream_errors = reg.counter(
            "velocity_upstream_errors_total",
            "Engine connection failures, by endpoint and kind.",
            ("endpoint", "kind"),
            merge=SUM,
        )
        eps = lambda attr: lambda: [((e.name, e.model), float(getattr(e, attr))) for e in gw.endpoints.values()]  # noqa: E731
        # The same engines, checked and scraped by every worker: each reports the whole.
        reg.gauge_fn(
            "velocity_endpoint_healthy",
            "1 when the endpoint is in routing, else 0.",
            eps("healthy"),
            ("endpoint", "model"),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_endpoint_role",
            "1 for each endpoint, labelled with its prefill/decode role (prefill, decode or both).",
            lambda: [((e.name, e.model, e.role), 1.0) for e in gw.endpoints.values()],
            ("endpoint", "model", "role"),
            merge=MAX,
        )

        def pd_ways():
            out = []
            for m, p in gw.pools.items():
                if p.pd is not None:
                    for way in ("disaggregated", "colocated", "prefill_busy", "prefill_failed"):
                        out.append(((m, way), float(getattr(p.pd, way))))
            return out

        reg.counter_fn(
            "velocity_pd_requests_total",
            "Requests of a pool with prefill/decode roles: disaggregated (two legs), colocated "
            "(the decider ran them on the decode engine alone), prefill_busy (on the decode "
            "engine alone: every prefill engine at pd.max_prefill_tokens_in_flight), "
            "prefill_failed (503 after the prefill leg failed twice).",
            pd_ways,
            ("model", "way"),
            merge=SUM,
        )
        reg.gauge_fn(
            "velocity_endpoint_engine_running",
            "Engine-reported running requests (last scrape).",
            eps("running"),
            ("endpoint", "model"),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_endpoint_engine_waiting",
            "Engine-reported waiting requests (last scrape).",
            eps("waiting"),
            ("endpoint", "model"),
            merge=MAX,
        )
        reg.gauge_fn(
            "velocity_endpoint_kv_usage",
            "Engine-reported KV-cache usage, 0..1 (last scrape).",
            eps("kv_usage"),
            ("endpoint", "model"),
            merge=MAX,
        )

        def connections():
            out = []
            for e in gw.endpoints.values():
                if e.upstream is not None:
                    st = e.upstream.stats()
                    out += [((e.name, "open"), float(st["open"])), ((e.name, "idle"), float(st["idle"]))]
            return out

        reg.gauge_fn(
            "velocity_upstream_connections",
            "Connections this process holds to an engine: open (in "
            "use or idle) and idle; at most max_concurrency + 2 once its requests end.",
            connections,
            ("endpoint", "state"),
            merge=SUM,
        )  # each worker's pool is its own

        # Per tenant, read at scrape time from the tenants and the band queues (/stats'
        # "tenants"): configured tenants, and others once they have a counter in a band.
        def served():
            return [
                ((n, kind), float(v))
                for n, t in gw.identity.tenants.items()
                for kind, v in (
                    ("prompt", t.served_prompt),
                    ("cached", t.served_cached),
                    ("completion", t.served_completion),
                )
            ]

        def quota():
            return [((n,), t.tokens_left()) for n, t in gw.identity.tenants.items() if t.tpm is not None]

        def rejected():
            return [
                ((n, reason), float(c)) for n, t in gw.identity.tenants.items() for reason, c in t.rejections.items()
            ]

        def per_band(key):
            return lambda: [
                ((n, band), float(v[key])) for n, s in gw.tenant_stats().items() for band, v in s["bands"].items()
            ]

        reg.counter_fn(
            "velocity_tenant_tokens_served_total",
            "Tokens the engines served a tenant, from their usage (kind: prompt, cached (of the prompt), completion).",
            served,
            ("tenant", "kind"),
            merge=SUM,
        )
        reg.gauge_fn(
            "velocity_tenant_quota_tokens_left",
            "Tokens left in a tenant's tokens_per_minute bucket (below 0: in debt).",
            quota,
            ("tenant",),
            merge=MAX,
        )  # one bucket, shared
        reg.counter_fn(
            "velocity_tenant_rejections_total",
            "A tenant's requests declined, by reason.",
            rejected,
            ("tenant", "reason"),
            merge=SUM,
        )
        reg.gauge_fn(
            "velocity_tenant_fairness_counter",
            "A tenant's virtual token counter in a band (fairness: tokens).",
            per_band("counter"),
            ("tenant", "band"),
            merge=MAX,
        )  # shared counter
        reg.gauge_fn(
            "velocity_tenant_queue_depth",
            "A tenant's requests queued in a band.",
            per_band("queued"),
            ("tenant", "band"),
            merge=SUM,
        )  # each worker's queues
        started = time.monotonic()
        reg.gauge_fn(
            "velocity_uptime_seconds",
            "Seconds since the gateway started.",
            lambda: time.monotonic() - started,
            merge=MAX,
        )


class _JsonFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "message": record.getMessage(),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        for key in ("endpoint", "status", "reason", "band", "tenant"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(structured: bool, level: str = "info", worker: int | None = None) -> None:
    """One JSON object a line with --structured-logs, plain text otherwise. A worker of a
    supervisor (``worker``: its index) says which it is on every line (a `worker` field),
    since each worker logs what it does (a reload, an endpoint's health) on its own."""
    handler = logging.StreamHandler(sys.stderr)
    if structured:
        handler.setFormatter(_JsonFormatter(worker))
    else:
        who = "" if worker is None else f"worker {worker} "
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
