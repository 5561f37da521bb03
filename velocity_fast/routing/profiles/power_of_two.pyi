"""Stubs for velocity_fast.routing.profiles.power_of_two (the ``power-of-two`` routing profile)."""

from velocity_fast.routing.plugins import Profile

class PowerOfTwoProfile(Profile):
    """Two candidates at random; the less loaded takes the request."""
