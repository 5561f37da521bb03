"""Stubs for velocity_fast.routing.profiles.round_robin (the ``round-robin`` routing profile)."""

from velocity_fast.routing.plugins import Profile

class RoundRobinProfile(Profile):
    """The ``round-robin`` profile: endpoints in turn, in pool order."""
