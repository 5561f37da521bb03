"""Stubs for velocity_fast.state.bucket (a token bucket and its three homes)."""

from typing import Any

SHARE_S: float

class Bucket:
    rate: float
    cap: float
    def draw(self, amount: float, need: float) -> float: ...
    def settle(self, delta: float) -> None: ...
    def left(self) -> float: ...
    def take_over(self, prev: Bucket) -> None: ...

class LocalBucket(Bucket):
    level: float
    stamp: float
    def __init__(self, rate: float, cap: float) -> None: ...

class ShmBucket(Bucket): ...

class StoreBucket(Bucket):
    store: Any
    key: str
    chunk: float
    low: float
    need: float
    held: float
    debt: float
    asking: bool
    not_before: float
    shared_level: float
    replicas: int
    room: float
    answered: float
    up: bool
    fallback: LocalBucket
    spent: float
    def __init__(self, store: Any, key: str, rate: float, cap: float, floor: float) -> None: ...
    def to_local(self) -> None: ...

def make_bucket(tenant: str, kind: str, rate: float, cap: float, store: Any = None) -> Bucket: ...
