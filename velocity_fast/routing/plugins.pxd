# The steps of a pick, declared once: filter, score, pick (see plugins.pyx for the why).
# Each named filter (filters.pyx), the load (load.pyx) and each profile (profiles/) is a
# cdef class of this interface; the router holds them typed and calls them as C.

from velocity_fast.fleet.endpoint cimport Endpoint, RoomFilter
from velocity_fast.metrics.values cimport Value
from velocity_fast.routing.route cimport RouteInfo, RouterPool

# What a filter says of an endpoint. Past KEEP, the order the router falls back through:
# the endpoints kept, else the full ones, else (fail open) the saturated ones; never DROP.
cdef enum Verdict:
    KEEP = 0
    FULL = 1
    SATURATED = 2
    DROP = 3


cdef inline bint gauges_fresh(Endpoint ep, double now, double stale_s) noexcept:
    """Whether ep's engine gauges were scraped at most stale_s ago (never: not fresh)."""
    return ep.scraped_at != 0.0 and now - ep.scraped_at <= stale_s


cdef class Pick:
    """What the steps of one pick read besides the endpoint: one object a router, refilled
    for each request (no allocation per pick)."""
    cdef public double now          # the router's clock
    cdef public double stale_s      # engine gauges older than this are not read
    cdef public object has_room     # has_room(ep) -> bool, or None: every endpoint has room
    cdef public RoomFilter room_filter  # has_room when it is a RoomFilter (asked as C), else None
    cdef public object exclude      # endpoints not to use (a retry's failed ones), or ()


cdef class Filter:
    # KEEP, FULL, SATURATED or DROP (Verdict) for ep in this pick (VERDICTS[i] is its name).
    cpdef int check(self, Endpoint ep, Pick pick) except -1


cdef class Scorer:
    # A number for ep in this pick, which the profiles weigh (the load, in requests).
    cpdef double score(self, Endpoint ep, Pick pick) except? -1.0


cdef class Profile:
    cdef readonly object settings   # RoutingSettings
    cdef readonly object rng        # the router's random.Random (ties)
    cdef public str basis           # what decided the last choose (the picks metric's basis)
    cdef dict picks                 # basis -> its velocity_route_picks_total child (the router's)
    cdef Value only                 # the child of picks with one candidate (basis "only")
    # The position in cands (two or more, in pool order) of the endpoint that takes the
    # request; loads[i] is the load of cands[i]. Sets basis.
    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1


# The position of the least load (among the positions in ``among``, when given), ties (within 1e-9)
# at random from ``rng``: the rule the load-balancing profiles share.
cdef Py_ssize_t least_loaded(object rng, list loads, list among=*) except -1
