"""Gateway flags for `serve` and `chargeVelocity`. Imports nothing heavy.

Every default is None so that the precedence flag > VELOCITY_* > config file > default
can tell a flag that was given from one that was not.
"""

from __future__ import annotations

import argparse

__all__ = ["add_gateway_arguments", "flag_overrides"]


def add_gateway_arguments(parser: argparse.ArgumentParser, *, endpoints: bool = True) -> None:
    g = parser.add_argument_group("gateway")
    g.add_argument("--config", default=None, help="YAML config file (also VELOCITY_CONFIG); see deploy/")
    g.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    g.add_argument("--port", type=int, default=None, help="client port (default 8000)")
    g.add_argument("--admin-port", type=int, default=None, help="admin port: /metrics, /ready, /stats (default 9090)")
    g.add_argument(
        "--policy", choices=("static", "dynamic", "smart"), default=None, help="admission policy (default dynamic)"
    )
    g.add_argument("--sla-ms", type=float, default=None, help="default latency SLA in ms (default 3000)")
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="upper bound of the adaptive concurrency limit per engine (default 32)",
    )
    g.add_argument("--api-key", default=None, help="key clients must present (Bearer or X-API-Key)")
    g.add_argument("--structured-logs", action="store_true", default=None, help="one JSON object per log line")
    g.add_argument(
        "--log-level",
        default=None,
        choices=("debug", "info", "warning", "error"),
        help="least severe messages logged (default info)",
    )
    g.add_argument(
        "--prefix",
        default=None,
        choices=("approximate", "precise", "off"),
        help="prefix affinity of the chat profile, which every policy routes with unless "
        "configured otherwise: where this gateway sent prompts (approximate), the engines' "
        "KV cache events (precise: needs --tokenizer and endpoints' kv_events in the config "
        "file; chargeVelocity sets those up for its engines), or none (off) (default approximate)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json (or a model folder) for precise prefix routing",
    )
    g.add_argument(
        "--state-store",
        default=None,
        metavar="redis://HOST:PORT/DB",
        help="Redis that holds the tenant limits every replica shares; without one each replica applies them alone",
    )
    g.add_argument(
        "--workers",
        default=None,
        metavar="N|auto",
        help="gateway processes that share the client port under a supervisor, which restarts "
        "a dead one, relays SIGHUP and SIGTERM and reports the whole gateway on the admin "
        "port; auto: one per core; 1: one process, no supervisor (default 1)",
    )
    if endpoints:
        g.add_argument(
            "--endpoint",
            action="append",
            default=None,
            metavar="NAME=URL=MODEL",
            help="an engine the gateway sends to (repeatable; chargeVelocity adds the engines it starts)",
        )


def flag_overrides(args: argparse.Namespace) -> dict:
    """The flags that were given, as settings keys."""
    from ..config import parse_endpoint_flag

    out = {}
    for key in (
        "host",
        "port",
        "admin_port",
        "policy",
        "sla_ms",
        "max_concurrency",
        "api_key",
        "structured_logs",
        "log_level",
        "max_model_len",
        "model_path",
        "state_store",
        "workers",
        "engine",
        "vllm_python",
    ):
        v = getattr(args, key, None)
        if v is not None:
            out[key] = v
    routing = {k: getattr(args, k, None) for k in ("prefix", "tokenizer")}
    routing = {k: v for k, v in routing.items() if v is not None}
    if routing:
        out["routing"] = routing
    eps = getattr(args, "endpoint", None)
    if eps:
        out["endpoints"] = [parse_endpoint_flag(e) for e in eps]
    return out
