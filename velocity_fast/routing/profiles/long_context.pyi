"""Stubs for velocity_fast.routing.profiles.long_context (the ``long-context`` routing profile)."""

from velocity_fast.routing.plugins import Profile

class LongContextProfile(Profile):
    """The ``long-context`` profile: the most free KV cache, requests sent since the last scrape counted as taking blocks."""
