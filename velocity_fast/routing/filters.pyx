# cython: annotation_typing=False
"""The router's filters, in the order it asks them (``FILTERS``): the first that does not
keep an endpoint decides (plugins.pyx, ``Filter``).

- ``unhealthy``: an engine that failed its health checks, or that passive checks ejected.
- ``no-room``: ``has_room(ep)`` False (at its concurrency limit, or past the band's
  ceiling there); asked only of healthy endpoints, as C where it is a ``RoomFilter``.
- ``excluded``: an endpoint a retry already failed on.
- ``saturated``: on fresh gauges, an engine queue or KV usage past the thresholds. Kept
  aside: when it would remove every endpoint the saturated ones stay (fail open), since
  admission already decided that this request goes now and refusing here would only turn
  a slow answer into an error.
- ``full``: the batch admission learned for the engine all in flight (``running_cap``;
  ours, and other replicas' as the last scrape showed it). Kept aside, and preferred to
  saturated ones: a band never held back may go past an engine's batch, and there it
  would wait in the engine's FIFO while another engine could run it at once.
"""

from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.routing.plugins cimport DROP, FULL, KEEP, SATURATED, Pick, gauges_fresh

__all__ = ["Unhealthy", "NoRoom", "Excluded", "Saturated", "Full", "make_filters"]


cdef class Unhealthy(Filter):
    """Drops an engine that is not healthy."""

    name = "unhealthy"

    cpdef int check(self, Endpoint ep, Pick pick) except -1:
        return KEEP if ep.healthy else DROP


cdef class NoRoom(Filter):
    """Drops an endpoint without room for this request (the pick's ``has_room``)."""

    name = "no-room"

    cpdef int check(self, Endpoint ep, Pick pick) except -1:
        if pick.room_filter is not None:
            return KEEP if pick.room_filter.has_room(ep) else DROP
        if pick.has_room is None or pick.has_room(ep):
            return KEEP
        return DROP


cdef class Excluded(Filter):
    """Drops an endpoint the pick excludes (a retry's failed one)."""

    name = "excluded"

    cpdef int check(self, Endpoint ep, Pick pick) except -1:
        return DROP if pick.exclude and ep in pick.exclude else KEEP


cdef class Saturated(Filter):
    """Keeps aside an engine whose fresh gauges show ``waiting`` queued or ``kv`` KV usage."""

    name = "saturated"

    def __init__(self, double waiting, double kv):
        self.waiting = waiting
        self.kv = kv

    cpdef int check(self, Endpoint ep, Pick pick) except -1:
        if gauges_fresh(ep, pick.now, pick.stale_s) and (ep.waiting >= self.waiting or ep.kv_usage >= self.kv):
            return SATURATED
        return KEEP


cdef class Full(Filter):
    """Keeps aside an engine whose learned batch is all in flight."""

    name = "full"

    cpdef int check(self, Endpoint ep, Pick pick) except -1:
        if ep.running_cap > 0.0 and <double>ep.inflight + ep.others >= ep.running_cap:
            return FULL
        return KEEP


def make_filters(settings):
    """The router's filters, in the order it asks them."""
    if not settings.spill:  # pure affinity: room is not asked (an engine queues what it cannot run)
        return (Unhealthy(), Excluded(), Saturated(settings.saturation_waiting, settings.saturation_kv))
    return (Unhealthy(), NoRoom(), Excluded(), Saturated(settings.saturation_waiting, settings.saturation_kv),
            Full())
