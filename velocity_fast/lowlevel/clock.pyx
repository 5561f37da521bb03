"""The time of the I/O event being handled: one clock read for all that one read of a
socket sets off.

A request's read is parsed, admitted, routed and sent to its engine in one call chain, and
an engine's answer is relayed, released and accounted in another; each step wants the
time (a deadline, a queue wait, a lease's bind time, the router's staleness checks), and
each read of the clock costs about 20 ns, eight or nine of them a request. The protocols
bracket the handling of one read with ``event_begin``/``event_end``; within it
``event_now`` gives the time the read began, outside it a fresh read. The handling of one
read takes microseconds, so the times agree with fresh reads to that, and a timer or any
code outside a read's handling still reads the clock itself.

Nested brackets (a read handed on to another of the protocol's methods) keep the outer
time; ``event_end`` restores what ``event_begin`` returned.
"""

cdef double _event = 0.0


cdef double event_begin() noexcept:
    """Start (or, nested, keep) the event's time; returns what to give ``event_end``."""
    global _event
    cdef double prev = _event
    if prev == 0.0:
        _event = monotonic()
    return prev


cdef void event_end(double prev) noexcept:
    global _event
    _event = prev


cdef double event_now() noexcept:
    """The handled event's time, or the clock itself outside an event."""
    if _event != 0.0:
        return _event
    return monotonic()
