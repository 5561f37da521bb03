"""Stubs for velocity_fast.routing.load (an endpoint's load: the scorer every profile weighs)."""

from velocity_fast.routing.plugins import Scorer

class EngineLoad(Scorer):
    """Engine waiting (on fresh gauges) + gateway in flight."""
