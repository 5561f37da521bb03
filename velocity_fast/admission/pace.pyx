"""The decode pace: whether an engine decodes fast enough for the deadline work granted.

A fuller batch decodes each token slower. Each grant with a deadline notes the pace its
decoding needs (what is left of its deadline past the expected first token, with a
margin, a token: ``note_grant``); a pool keeps the tightest need of the last window or
two. A scrape that shows an engine slower than that need holds its limit (no growth)
and, well past it, cuts it: what runs there now would end late. A need that no engine
of the pool meets but running one or two sequences (within VF_PACE_ROOM of its solo
pace) is no reason to hold or cut: no limit worth holding serves it, and a cut would only
decline what can be served (docs/design.md, "Pace").

Admission (controller.pyx) holds a PoolPace per pool and an EndpointPace per endpoint
and calls these as C; the constants live in csrc/admission_consts.h.
"""

from libc.math cimport INFINITY

from velocity_fast.fleet.endpoint cimport Endpoint

PACE_MARGIN = VF_PACE_MARGIN
PACE_HOLD = VF_PACE_HOLD
PACE_CUT = VF_PACE_CUT
PACE_WINDOW_S = VF_PACE_WINDOW_S


cdef class EndpointPace:
    """One engine's pace as admission judges it."""


cdef class PoolPace:
    """One pool's pace needs, and its engines' best."""

    def __init__(self):
        self.need = self.need_before = INFINITY
        self.since = -INFINITY
        self.endpoints = []


cdef void _note_solo(PoolPace p, EndpointPace e, double pace, list seen) except *:
    """``e``'s engine decoded at ``pace`` running one sequence at most: its solo pace,
    and the pool's fastest (0 while one of its healthy engines has shown none)."""
    cdef EndpointPace other
    cdef Endpoint ep
    cdef double best = INFINITY
    cdef Py_ssize_t i
    e.solo = pace
    if p is None:
        return
    for i in range(len(p.endpoints)):
        other = <EndpointPace>p.endpoints[i]
        ep = <Endpoint>seen[i]
        if not ep.healthy:
            continue
        if other.solo <= 0.0:
            best = 0.0
            break
        if other.solo < best:
            best = other.solo
    p.solo = best if best != INFINITY else 0.0


cdef bint observe(PoolPace p, EndpointPace e, double pace, double batch, list seen, double now) except -1:
    """A scrape showed ``e``'s engine decoding at ``pace`` seconds a token (0: unknown)
    with ``batch`` sequences running; ``p``: its pool's pace (None: no such pool), whose
    endpoints are ``seen``. Sets ``e.high`` (its limit must not grow); True when the pace
    is past the need by so much that the limit is cut."""
    cdef double need
    if pace > 0.0 and batch <= 1.0 and pace != e.solo:
        _note_solo(p, e, pace, seen)
    need = need_now(p, now) if p is not None and pace > 0.0 else INFINITY
    if need * VF_PACE_HOLD < e.solo * VF_PACE_ROOM:
        # Slower than that but near alone: no limit worth holding makes that work meet
        # its need, and a cut would only decline what can be served.
        need = INFINITY
    e.high = pace > need * VF_PACE_HOLD
    return pace > need * VF_PACE_CUT
