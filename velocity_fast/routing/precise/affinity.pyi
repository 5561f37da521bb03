"""Stubs for velocity_fast.routing.precise.affinity (the chat profile's rule over known affinities)."""

def score(
    aff: list[float],
    loads: list[float],
    hotspot_gap: float,
    load_weight: float,
    rand: int,
    waits: list[float] | None = None,
    hotspot_waiting: float = 2.0,
) -> tuple[int, str]:
    """(position, basis): "prefix", "hotspot" or "load", as choose_by_affinity decides."""
