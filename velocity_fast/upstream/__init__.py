"""Engine connections: keep-alive pools, response relay, cancellation by closing."""

from .connection import UpstreamConnection, UpstreamError
from .pool import UpstreamPool, request_head

__all__ = ["UpstreamConnection", "UpstreamError", "UpstreamPool", "request_head"]
