"""Stubs for velocity_fast.routing.filters (the router's named filters, in order)."""

from velocity_fast.routing.plugins import Filter
from velocity_fast.routing.settings import RoutingSettings

class Unhealthy(Filter):
    """Drops an engine that is not healthy."""

class NoRoom(Filter):
    """Drops an endpoint without room for this request (the pick's ``has_room``)."""

class Excluded(Filter):
    """Drops an endpoint the pick excludes (a retry's failed one)."""

class Saturated(Filter):
    """Keeps aside an engine whose fresh gauges show ``waiting`` queued or ``kv`` KV usage."""
    def __init__(self, waiting: float, kv: float) -> None: ...
    @property
    def waiting(self) -> float: ...
    @property
    def kv(self) -> float: ...

class Full(Filter):
    """Keeps aside an engine whose learned batch is all in flight."""

def make_filters(settings: RoutingSettings) -> tuple[Filter, ...]:
    """The router's filters, in the order it asks them."""
