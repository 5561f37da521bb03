"""Stubs for velocity_fast.routing.profiles.least_loaded (the ``least-loaded`` routing profile)."""

from velocity_fast.routing.plugins import Profile

class LeastLoadedProfile(Profile):
    """The ``least-loaded`` profile: the fewest requests in flight from this gateway."""
