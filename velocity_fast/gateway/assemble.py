"""Builds the gateway's admission controller and router from the settings.

The admission policies themselves (static, dynamic, smart) live in admission/policies.py.
"""

from __future__ import annotations

from velocity_fast.admission.controller import Admission
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.config import Settings
from velocity_fast.fleet.endpoint import Pool
from velocity_fast.gateway.exchange import drive_exchanges
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["build_admission", "build_router", "routing_settings"]


def build_admission(settings: Settings, pools: dict[str, Pool], registry: Registry) -> Admission:
    """The admission controller, told to drive the gateway's exchanges (its queue's
    waiters) as C."""
    adm = Admission(settings, pools, policy=settings.policy, registry=registry)
    drive_exchanges(adm)
    return adm


def routing_settings(settings: Settings) -> RoutingSettings:
    """The routing section, with what it shares with admission filled in from there.

    Every policy routes with the `chat` profile (prefix affinity) unless
    `routing.default_profile` or a model's profile says otherwise (RoutingSettings' default).
    """
    data = dict(settings.routing)
    adm = AdmissionSettings.from_settings(settings)
    data.setdefault("saturation_waiting", adm.queue_threshold)
    data.setdefault("saturation_kv", adm.kv_threshold)
    return RoutingSettings.from_config(data, settings.models)


def build_router(settings: Settings, registry: Registry, precise=None) -> Router:
    """The router; ``precise``: the token side of precise pools (gateway/kv.py), or None."""
    return Router(routing_settings(settings), registry=registry, precise=precise)
