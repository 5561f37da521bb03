"""Stubs for velocity_fast.gateway.usage (the engine's usage read from its answer)."""

def body_usage(body: bytes) -> tuple[int, int, int] | None:
    """(prompt, cached, completion) tokens of a whole answer's usage, or None (tests)."""
