"""Stubs for velocity_fast.admission.pace (the decode pace admission judges engines by)."""

PACE_MARGIN: float
PACE_HOLD: float
PACE_CUT: float
PACE_WINDOW_S: float

class EndpointPace:
    """One engine's pace as admission judges it."""

    high: bool
    solo: float

class PoolPace:
    """One pool's pace needs, and its engines' best."""

    need: float
    need_before: float
    since: float
    solo: float
    endpoints: list[EndpointPace]
    def __init__(self) -> None: ...
