"""The routing profiles: how the router scores and picks among the endpoints its filters
left (docs/configuration.md, "Routing profiles").

Each profile is a ``Profile`` (routing/plugins.pxd) in its own module here, its test in
tests/routing/profiles/, and one line of ``REGISTRY`` below: adding a profile touches
nothing else. The router calls a profile's ``choose`` as C; the modules are imported
when the first router is made, so that reading the settings imports no compiled code.
"""

from __future__ import annotations

import importlib
import random
from typing import Any

__all__ = ["REGISTRY", "PROFILES", "profile_class", "make_profiles"]

# name -> "module.Class" of this package.
REGISTRY = {
    "chat": "chat.ChatProfile",
    "batch": "batch.BatchProfile",
    "long-context": "long_context.LongContextProfile",
    "round-robin": "round_robin.RoundRobinProfile",
    "least-loaded": "least_loaded.LeastLoadedProfile",
    "power-of-two": "power_of_two.PowerOfTwoProfile",
}

PROFILES = tuple(REGISTRY)


def profile_class(name: str) -> type:
    """The class of a registered profile (KeyError for another name)."""
    module, _, cls = REGISTRY[name].rpartition(".")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_profiles(settings: Any, rng: random.Random, sessions: Any) -> dict[str, Any]:
    """The profiles by name, each made with the routing settings, the router's random
    generator and its session map."""
    return {name: profile_class(name)(settings, rng, sessions) for name in REGISTRY}
