"""Stubs for velocity_fast.gateway.exchange (one proxied request's state machine)."""

import logging
from typing import Any

from velocity_fast.gateway.ingress import Ingress
from velocity_fast.upstream.connection import ResponseHandler

log: logging.Logger

class Exchange(ResponseHandler):
    """One proxied request: admission, routing, the engine request and the relay back (made by the
    proxy path; no public constructor)."""
    @property
    def ingress(self) -> Ingress: ...
    @property
    def req(self) -> Any: ...
    @property
    def resp(self) -> Any: ...
    @property
    def route(self) -> str: ...
    @property
    def pool(self) -> Any: ...
    @property
    def ticket(self) -> Any: ...
    @property
    def info(self) -> Any: ...
    @property
    def body(self) -> bytes: ...
    @property
    def rid(self) -> str: ...
    @property
    def state(self) -> int: ...
    @property
    def lease(self) -> Any: ...
    @property
    def ep(self) -> Any: ...
    @property
    def conn(self) -> Any: ...
    @property
    def queue_s(self) -> float: ...
    def start(self) -> None: ...
    def __call__(self) -> None:
        """The client's disconnect callback (the Responder calls it once, as on_disconnect)."""
    def done(self) -> bool: ...
    def set_result(self, lease: Any) -> None: ...
    def set_exception(self, exc: BaseException) -> None: ...
    def on_disconnect(self) -> None: ...
    def base_headers(self) -> list[tuple[str, str]]: ...
    def out_headers(self) -> list[tuple[str, str]]: ...

class GenExchange(Exchange):
    """/v1/responses and /v1/messages: an Exchange that reads usage from their own stream events."""

def start_generation(
    ingress: Ingress,
    req: Any,
    resp: Any,
    route: str,
    pool: Any,
    ticket: Any,
    info: Any,
    body: bytes,
    rid: str,
    tenant: Any,
    q_est: float,
    stream: bool,
    asked: int | None = None,
) -> None:
    """/v1/responses and /v1/messages through admission and routing, as chat."""

def drive_exchanges(adm: Any) -> None:
    """Have ``adm``'s dispatch cycle drive the gateway's exchanges as C."""
