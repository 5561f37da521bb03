"""Stubs for velocity_fast.gateway.ingress (the gateway's front door)."""

import logging
from typing import Any

log: logging.Logger

class Ingress:
    """What every proxied request reads of its gateway: C fields instead of instance-dict look-ups.

    ``app`` is the gateway above (gateway/app.py), called for what is not the proxy path."""

    app: Any
    identity: Any
    router: Any
    admission: Any
    monitor: Any
    metrics: Any
    pools: dict[str, Any]
    default_model: str | None
    band_names: list[str]
    max_model_len: int
    loop: Any
    tracing: Any  # gateway/tracing.py's Tracing when tracing is on, else None
    def answer_internal_error(self, req: Any, resp: Any, what: Any = None) -> None:
        """The client server's on_error: a counted 500 with the request id."""

def new_request_id() -> str: ...
def handle_client(ingress: Ingress, req: Any, resp: Any) -> Any: ...
def band_for(names: list[str], raw: Any, tenant: Any, default: str | None = None) -> str: ...
def proxy(ingress: Ingress, req: Any, resp: Any, route: str, chat: bool, bound: Any = ...) -> Any: ...
def settle(
    ingress: Ingress,
    route: str,
    band: str,
    ep: Any,
    lease: Any,
    status: int,
    engine_failed: bool,
    ok: bool,
    error_text: Any,
    events: int,
) -> None: ...
def generate(ingress: Ingress, req: Any, resp: Any) -> Any:
    """POST /generate through the same checks and exchange as the OpenAI routes."""

def place_generation(
    ingress: Ingress,
    req: Any,
    resp: Any,
    route: str,
    rid: str,
    band: str,
    tenant: Any,
    tenant_name: Any,
    sla_ms: float | None,
    model: Any,
    info: Any,
    body: bytes,
    max_tokens: int | None,
    param: str,
    stream: bool,
) -> Any:
    """/v1/responses and /v1/messages from their pool on, through the same checks as the OpenAI routes."""
