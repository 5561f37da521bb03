# cython: annotation_typing=False
"""The steps of a pick: filter, score, pick. Each is a small class of this interface, and
the router calls them as C (a vtable call, no Python dispatch on the request path).

- ``Filter.check(ep, pick)``: KEEP the endpoint, DROP it, or keep it aside as FULL (its
  learned batch all in flight) or SATURATED (its queue or KV past the thresholds). The
  router asks its filters in order; the first that does not keep an endpoint decides
  (filters.pyx: unhealthy, no room, excluded, saturated, full).
- ``Scorer.score(ep, pick)``: a number for each candidate; the router's is the load
  (load.pyx), which every profile weighs.
- ``Profile.choose(cands, loads, info, state)``: the profile's own scoring and its pick
  among two or more candidates, as their position; it says what decided in ``basis``.
  One profile a module in profiles/, registered by one line of profiles/__init__.py.

``Pick`` carries what the steps read besides the endpoint (the clock, staleness, the
request's room test and exclusions): the router owns one and refills it per request.
"""

__all__ = ["Pick", "Filter", "Scorer", "Profile", "VERDICTS"]


cdef class Pick:
    """What the steps of one pick read besides the endpoint (the router refills one per request)."""

    def __init__(self, double stale_s=2.0):
        self.now = 0.0
        self.stale_s = stale_s
        self.exclude = ()

    def fresh(self, Endpoint ep not None):
        """Whether ep's engine gauges are fresh at ``now`` (read as C by the steps)."""
        return gauges_fresh(ep, self.now, self.stale_s)


cdef class Filter:
    """A filter of a pick: says KEEP, FULL, SATURATED or DROP of an endpoint."""

    name = ""

    cpdef int check(self, Endpoint ep, Pick pick) except -1:
        """KEEP, FULL, SATURATED or DROP of ep in this pick (``VERDICTS[i]`` is its name)."""
        raise NotImplementedError


# The names of the verdicts, by their value (Verdict in plugins.pxd).
VERDICTS = ("keep", "full", "saturated", "drop")


cdef class Scorer:
    """A scorer of a pick: one number for each candidate endpoint."""

    name = ""

    cpdef double score(self, Endpoint ep, Pick pick) except? -1.0:
        """A number for ep in this pick (the load, in requests, for the router's)."""
        raise NotImplementedError


cdef class Profile:
    """A routing profile: its scoring and its pick among the candidates the filters left.

    Subclasses implement ``choose`` (a cdef method) and set ``name``; the constructor takes
    the routing settings, the router's random generator (for ties) and its session map
    (which only the profiles that honour sessions keep).

    A profile declares what of the request it reads, and the router asks it, not its name:
    ``needs_prefix`` (False: the router renders and hashes no prompt for it, and its
    dispatches add nothing to the prefix index) and ``precise`` (True: in a precise pool
    the router hands its requests to the token side, whose scores it reads)."""

    name = ""
    needs_prefix = True
    precise = False

    def __init__(self, settings, rng, sessions=None):
        self.settings = settings
        self.rng = rng
        self.basis = None

    cdef Py_ssize_t choose(self, list cands, list loads, RouteInfo info, RouterPool state) except -1:
        raise NotImplementedError

    def decide(self, list cands not None, list loads not None, RouteInfo info not None,
               RouterPool state not None):
        """choose, from Python (tests, tools): (position in cands, basis)."""
        if len(cands) < 2 or len(loads) != len(cands):
            raise ValueError("two or more candidates, and a load for each")
        cdef Py_ssize_t i = self.choose(cands, loads, info, state)
        return i, self.basis


# Loads closer than this are a tie (float noise must not defeat the random tie-break).
cdef double TIE_EPS = 1e-9


cdef Py_ssize_t least_loaded(object rng, list loads, list among=None) except -1:
    cdef Py_ssize_t n = len(loads) if among is None else len(among), i, at = 0, ties = 0, k
    cdef double low = 0.0, x
    for i in range(n):
        x = <double>loads[i if among is None else <Py_ssize_t>among[i]]
        if i == 0 or x < low:
            low = x
    for i in range(n):
        if <double>loads[i if among is None else <Py_ssize_t>among[i]] <= low + TIE_EPS:
            ties += 1
            at = i
    if ties > 1:  # the k-th of the tied ones, k at random (one draw, as random.choice)
        k = rng.randrange(ties)
        for i in range(n):
            if <double>loads[i if among is None else <Py_ssize_t>among[i]] <= low + TIE_EPS:
                if k == 0:
                    at = i
                    break
                k -= 1
    return at if among is None else <Py_ssize_t>among[at]
