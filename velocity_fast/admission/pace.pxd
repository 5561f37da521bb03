# The decode pace, typed (see pace.pyx for the why). The grant's note is inline here so
# that the dispatch cycle in controller.pyx pays no call for it.

from libc.math cimport INFINITY

cdef extern from "admission_consts.h":
    double VF_PACE_MARGIN
    double VF_PACE_HOLD
    double VF_PACE_CUT
    double VF_PACE_WINDOW_S
    double VF_PACE_ROOM


cdef class EndpointPace:
    # The engine's pace (seconds a token) is past what the pool's deadline work leaves
    # room for, or near it: its limit does not grow (docs/design.md, "Pace").
    cdef public bint high
    # The engine's pace running one sequence at most (0: not seen yet): the best any
    # limit can give, so a need past it is no reason to hold or cut the limit.
    cdef public double solo


cdef class PoolPace:
    # The tightest seconds a token that deadline work granted in this window and the
    # last one needs to meet its SLA (INFINITY: none), and when this window began.
    cdef public double need
    cdef public double need_before
    cdef public double since
    # The fastest solo pace of the pool's engines (0: one of them not known yet): a need
    # below it is one no engine meets at any batch, and is not noted.
    cdef public double solo
    # The pool's engines' paces, in the order of its endpoints (admission's PoolState.seen).
    cdef public list endpoints


cdef inline void note_need(PoolPace p, double need, double now) noexcept:
    """A deadline request was granted that needs ``need`` seconds a token or less."""
    if need * VF_PACE_HOLD < p.solo * VF_PACE_ROOM:
        return  # no engine of the pool decodes that fast but near alone: no limit worth holding serves it
    if now - p.since >= VF_PACE_WINDOW_S:
        p.need_before = p.need if now - p.since < 2.0 * VF_PACE_WINDOW_S else INFINITY
        p.need = INFINITY
        p.since = now
    if need < p.need:
        p.need = need


cdef inline void note_grant(PoolPace p, double deadline, double first_token, long max_tokens,
                            double now) noexcept:
    """A request was granted at ``now`` with ``deadline`` (INFINITY: none), its first token
    expected ``first_token`` seconds after: the pace its decoding needs is what is left of
    its deadline past that, with a margin, a token."""
    if deadline != INFINITY and max_tokens > 0:
        note_need(p, (deadline - now - first_token) * VF_PACE_MARGIN / <double>max_tokens, now)


cdef inline double need_now(PoolPace p, double now) noexcept:
    """The tightest pace the deadline work granted lately needs (INFINITY: none lately)."""
    cdef double d = now - p.since
    if d >= 2.0 * VF_PACE_WINDOW_S:
        return INFINITY
    if d >= VF_PACE_WINDOW_S:
        return p.need
    return p.need if p.need < p.need_before else p.need_before


cdef bint observe(PoolPace p, EndpointPace e, double pace, double batch, list seen, double now) except -1
