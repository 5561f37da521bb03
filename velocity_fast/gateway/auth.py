"""Who is calling: API keys, tenants and their rate limits.

Compiled (_core/identity.pyx): the gateway asks on every proxied request.
"""

from __future__ import annotations

from .._core.identity import DEFAULT_TENANT, Identity, Tenant

__all__ = ["Identity", "Tenant", "DEFAULT_TENANT"]
