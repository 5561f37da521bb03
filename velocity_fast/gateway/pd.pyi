"""Stubs for velocity_fast.gateway.pd (prefill/decode disaggregation)."""

from typing import Any

from velocity_fast.gateway.exchange import Exchange
from velocity_fast.upstream.connection import ResponseHandler

log: Any

class PdPool:
    """A pool's prefill/decode split (Pool.pd)."""

    not_decode: list
    not_prefill: list
    min_uncached: int
    prefill_timeout: float
    disaggregated: int
    colocated: int
    prefill_retries: int
    prefill_failed: int
    pending: dict
    def __init__(self, not_decode: list, not_prefill: list, min_uncached: int, prefill_timeout: float) -> None: ...
    def snapshot(self) -> dict: ...

def configure_pools(pools: dict, settings: Any) -> None:
    """Give each pool with roles its PdPool, the others None."""

class PrefillLeg(ResponseHandler):
    """The prefill leg's answer, handed to its exchange once."""

class PdExchange(Exchange):
    """An Exchange through a prefill engine and a decode engine."""
    def on_disconnect(self) -> None: ...
