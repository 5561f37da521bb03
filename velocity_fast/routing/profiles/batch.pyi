"""Stubs for velocity_fast.routing.profiles.batch (the ``batch`` routing profile)."""

from velocity_fast.routing.plugins import Profile

class BatchProfile(Profile):
    """The ``batch`` profile: the shortest queue (engine waiting + gateway in flight)."""
