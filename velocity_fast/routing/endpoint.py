"""Endpoints (one engine each) and pools (the endpoints serving one model).

Both are compiled (_core/endpoint.pyx): the request path reads their fields as C.
"""

from __future__ import annotations

from .._core.endpoint import Endpoint, Pool

__all__ = ["Endpoint", "Pool"]
