"""Stubs for velocity_fast.fleet.lease (a replica's lease of a shared bucket)."""
from typing import Any

LEASE_S: float

class SharedBucket:
    store: Any
    key: str
    rate: float
    cap: float
    chunk: float
    low: float
    need: float
    lease: float
    debt: float
    asking: bool
    not_before: float
    shared_level: float
    replicas: int
    room: float
    answered: float
    up: bool
    level: float
    stamp: float
    spent: float
    def __init__(self, store: Any, key: str, rate: float, cap: float, floor: float) -> None: ...
    def draw(self, amount: float, need: float) -> float: ...
    def settle(self, delta: float) -> None: ...
    def left(self) -> float: ...
    def to_local(self) -> None: ...
