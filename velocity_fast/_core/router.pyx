"""The router's request path, compiled: route_info, pick and on_dispatch.

``RouterCore`` holds what every request touches: the request's ``RouteInfo`` (profile,
prefix block hashes, session), the filters of ``pick`` (health, room, exclusions,
saturation on fresh gauges, fail open) and the prefix index's bookkeeping of
``on_dispatch``. ``velocity_fast.routing.Router`` is its Python subclass and keeps the
rest: construction (metrics, profiles), ``forget``, ``hit_ratio`` and ``stats``. The
rules are those of routing/router.py's module doc; this file only types them.
Endpoints are compiled too (_core/endpoint.pyx): their fields are read as C. The
profiles (routing/profiles.py) stay Python and read ``RouteInfo`` and ``RouterPool``
fields through descriptors.
"""

import time

from velocity_fast._core.clock cimport monotonic
from velocity_fast._core.endpoint cimport RoomFilter, pool_endpoints, pool_model
from velocity_fast._core.metric_values cimport Value
from velocity_fast._core.prefix cimport BlockHashes, PrefixHasher, PrefixIndex

# Leaf modules of the routing package (they import nothing of the router).
from velocity_fast.routing.prefix_render import render_prompt
from velocity_fast.routing.session import SessionAffinity

PROFILE_HEADER = "x-velocity-profile"
SESSION_HEADER = "x-session-id"

cdef str _PROFILE_HEADER = PROFILE_HEADER
cdef str _SESSION_HEADER = SESSION_HEADER
cdef str _BATCH = "batch"
cdef str _ONLY = "only"
cdef object _session_key = SessionAffinity.key
cdef object _py_monotonic = time.monotonic


cdef inline RouteInfo _new_info(model, profile, BlockHashes hashes, session, session_key):
    cdef RouteInfo info = RouteInfo.__new__(RouteInfo)
    info.model = model
    info.profile = profile
    info.hashes = hashes
    info.nblocks = hashes.n
    info.session = session
    info.session_key = session_key
    return info


cdef class RouteInfo:
    """What routing needs to know of one request, computed once before it waits."""

    def __init__(self, model, profile, BlockHashes hashes not None, session, session_key):
        self.model = model
        self.profile = profile
        self.hashes = hashes
        self.nblocks = len(hashes)
        self.session = session
        self.session_key = session_key

    def __repr__(self):
        return (f"<RouteInfo model={self.model!r} profile={self.profile} blocks={self.nblocks} "
                f"session={self.session!r}>")


cdef class RouterPool:
    """The router's memory of one pool: its prefix index and engine capacities seen."""

    def __init__(self, pool, settings):
        self.pool = pool
        self.index = PrefixIndex(settings.index_capacity)
        self.caps = {}
        # Index blocks per engine token: an engine KV block of block_size tokens holds
        # block_size * kv_scale index blocks.
        self.kv_scale = settings.bytes_per_token / settings.block_bytes
        self.default_capacity = settings.index_capacity

    cpdef double kv_capacity_blocks(self, ep) except? -1.0:
        """The engine's KV cache in index blocks, or 0 when it is not known."""
        nb = ep.num_gpu_blocks
        if not nb:
            return 0.0
        return <double>(nb * (ep.block_size or 16)) * self.kv_scale

    cpdef sync_capacity(self, ep):
        """Bound ep's LRU by its engine's KV cache once cache_config_info has told it."""
        name = ep.name
        nb = ep.num_gpu_blocks
        bs = ep.block_size
        seen = self.caps.get(name)
        # (nb, bs) == seen, without building the tuple on every dispatch.
        if seen is not None and (<tuple>seen)[0] == nb and (<tuple>seen)[1] == bs:
            return
        self.caps[name] = (nb, bs)
        cdef double cap = self.kv_capacity_blocks(ep)
        self.index.set_capacity(name, max(1, int(cap)) if cap else self.default_capacity)

    cpdef reclaim_slots(self):
        """Free the slots of endpoints that are no longer in the pool."""
        if self.pool is None:
            return
        present = {ep.name for ep in self.pool.endpoints}
        for name in self.index.names():
            if name not in present:
                self.index.remove(name)
                self.caps.pop(name, None)


cdef class RouterCore:
    """The compiled half of ``Router`` (routing/router.py): see the module doc."""

    def __cinit__(self):
        self._clock_fn = _py_monotonic
        self._mono = True

    def _configure(self):
        """Read the settings and metric children the request path uses (the settings are
        frozen; call again after replacing them)."""
        s = self.settings
        self._stale_s = s.metrics_stale_s
        self._sat_waiting = s.saturation_waiting
        self._sat_kv = s.saturation_kv
        self._model_profiles = s.profiles
        self._default_profile = s.default_profile
        self._fail_open_v = self._fail_open.labels()
        self._no_endpoint_v = self._no_endpoint.labels()
        self._blocks_sent_v = self._blocks_sent.labels()
        self._blocks_hit_v = self._blocks_hit.labels()

    @property
    def _clock(self):
        """The clock of metrics staleness; time.monotonic is read in C (the same clock)."""
        return self._clock_fn

    @_clock.setter
    def _clock(self, fn):
        self._clock_fn = fn
        self._mono = fn is _py_monotonic

    cdef double _now(self) except? -1.0:
        if self._mono:
            return monotonic()
        return self._clock_fn()

    cdef RouterPool _pool_state(self, model, pool):
        st = self._pools.get(model)
        if st is None:
            st = self._pools[model] = RouterPool(pool, self.settings)
        return <RouterPool?>st

    # -- per request -------------------------------------------------------------

    def route_info(self, model, body_obj, headers):
        """Profile, prefix block hashes and session of a request.

        body_obj is the decoded body (dict or Struct with `messages` or `prompt`), or the
        prompt bytes already rendered. Raises UnknownProfile for a bad x-velocity-profile.
        """
        return self._route_info(model, body_obj, headers)

    def pick(self, pool, RouteInfo info not None, has_room=None, exclude=()):
        """The endpoint of pool for this request, or None when none is healthy with room.

        exclude: endpoints not to use (those a retry already failed on)."""
        return self._pick(pool, info, has_room, exclude)

    def on_dispatch(self, ep, RouteInfo info not None):
        """Remember that info's prompt blocks were sent to ep (call once it is bound)."""
        self._on_dispatch(ep, info)

    cdef RouteInfo _route_info(self, model, body_obj, headers):
        cdef RouteInfo info
        model = model or ""
        if not headers and model is self._last_model and self._model_profiles is self._last_profiles:
            return self._last_info  # the usual request: the same model as the last, no routing headers
        profile = None
        session = None
        if headers:
            if type(headers) is dict:
                profile = (<dict>headers).get(_PROFILE_HEADER)
                session = (<dict>headers).get(_SESSION_HEADER)
            else:
                profile = headers.get(_PROFILE_HEADER)
                session = headers.get(_SESSION_HEADER)
        if profile:
            profile = profile.strip().lower()
            if profile not in self._profiles:
                # Imported here: routing/router.py imports this module while it loads.
                from velocity_fast.routing.router import UnknownProfile
                raise UnknownProfile(profile)
        else:
            profile = self._model_profiles.get(model, self._default_profile)
        if session:
            session = session.strip() or None
        if profile == _BATCH and not session:
            # Shortest queue needs no prefix: no rendering, no hashing, one shared RouteInfo.
            info = self._batch_infos.get(model)
            if info is None:
                info = _new_info(model, profile, self._hasher.hash(b"", model), None, None)
                if len(self._batch_infos) < 256:  # models come from clients: the cache stays bounded
                    self._batch_infos[model] = info
            # What decided it is the model and the profiles it maps to: the next request
            # with the same model object and no routing headers gets the same info.
            self._last_model = model
            self._last_info = info
            self._last_profiles = self._model_profiles
            return info
        if isinstance(body_obj, (bytes, bytearray, memoryview)):
            data = body_obj
        else:
            data = render_prompt(body_obj)
        return _new_info(model, profile, self._hasher.hash(data, model), session,
                         _session_key(session) if session else None)

    cdef object _pick(self, pool, RouteInfo info, has_room, exclude):
        cdef RouterPool state
        cdef double now, load, scraped, waiting, first_load = 0.0
        cdef double stale = self._stale_s, sat_wait = self._sat_waiting, sat_kv = self._sat_kv
        cdef bint check_room = has_room is not None
        cdef RoomFilter room = has_room if isinstance(has_room, RoomFilter) else None
        cdef list cands = None, loads = None
        cdef list saturated = None, saturated_loads = None
        cdef Endpoint ep, first = None
        state = self._pool_state(pool_model(pool), pool)
        if state.pool is not pool:  # made by on_dispatch, or the pool was replaced
            state.pool = pool
        now = self._now()
        for ep in pool_endpoints(pool):
            if not ep.healthy or (check_room and not (room.room(ep) if room is not None else has_room(ep))) \
                    or (exclude and ep in exclude):
                continue
            scraped = ep.scraped_at
            if scraped and now - scraped <= stale:
                waiting = ep.waiting
                load = waiting + <double>ep.inflight
                if waiting >= sat_wait or <double>ep.kv_usage >= sat_kv:
                    if saturated is None:
                        saturated, saturated_loads = [], []
                    saturated.append(ep)
                    saturated_loads.append(load)
                    continue
            else:
                load = <double>ep.inflight
            # The lists are made only when a second candidate comes (one is the common pool).
            if first is None:
                first, first_load = ep, load
                continue
            if cands is None:
                cands, loads = [first], [first_load]
            cands.append(ep)
            loads.append(load)
        if first is None:
            if not saturated:
                self._no_endpoint_v.value += 1.0
                return None
            cands, loads = saturated, saturated_loads
            self._fail_open_v.value += 1.0
        if cands is None or len(cands) == 1:
            chosen = first if cands is None else cands[0]
            # the count of picks without a choice, by profile: no tuple key to make
            if self._only_children is None:
                self._only_children = {}
            only = self._only_children.get(info.profile)
            if only is None:
                only = self._only_children[info.profile] = self._pick_children[(info.profile, _ONLY)]
            (<Value?>only).value += 1.0
            return chosen
        chosen, basis = self._profiles[info.profile].choose(cands, loads, info, state)
        (<Value?>self._pick_children[(info.profile, basis)]).value += 1.0
        return chosen

    cdef void _on_dispatch(self, Endpoint ep, RouteInfo info) except *:
        cdef Py_ssize_t n = info.nblocks, held
        cdef RouterPool state
        cdef PrefixIndex index
        if not n:
            return
        name = ep.name
        state = self._pool_state(ep.model, None)
        index = state.index
        if index.slot_of(name) < 0 and index.slot(name) < 0:
            state.reclaim_slots()
        state.sync_capacity(ep)
        held = index.touch(name, info.hashes)
        self._blocks_sent_v.value += n
        self._blocks_hit_v.value += held


# -- the load-blind profiles -------------------------------------------------------
#
# Profiles are dispatched by name in ``_pick`` (``choose`` of the request's profile,
# after the filters), so adding these two leaves the path of chat, batch and
# long-context as it was. They ignore prefix affinity, sessions and the engines'
# gauges: the classic balancers, for uniform traffic and as baselines.

cdef str _TURN = "turn"
cdef str _LOAD = "load"


cdef class RoundRobinProfile:
    """Endpoints in turn, in pool order: each pick takes the first candidate at or after
    the pool position following the last pick (wrapping around), so the endpoints the
    filters leave share the traffic evenly whatever the load."""

    name = "round-robin"

    def __init__(self, settings, rng):
        self.settings = settings
        self.rng = rng

    def choose(self, list cands not None, list loads, RouteInfo info, RouterPool state not None):
        cdef list eps = pool_endpoints(state.pool) if state.pool is not None else cands
        cdef Py_ssize_t n = len(eps), j = 0, turn = state.turn, first_pos = -1
        first = None
        # cands are in pool order (the filters keep it): one walk finds their positions.
        for c in cands:
            while j < n and eps[j] is not c:
                j += 1
            if j == n:
                break
            if first_pos < 0:
                first_pos, first = j, c
            if j >= turn:
                state.turn = j + 1
                return c, _TURN
        if first is None:  # candidates not found in the pool's order: take them in turn
            first_pos = turn % len(cands)
            first = cands[first_pos]
        state.turn = first_pos + 1
        return first, _TURN


cdef class LeastLoadedProfile:
    """The fewest requests in flight from this gateway (least connections); the engines'
    gauges are not read. Ties are broken at random."""

    name = "least-loaded"

    def __init__(self, settings, rng):
        self.settings = settings
        self.rng = rng

    def choose(self, list cands not None, list loads, RouteInfo info, RouterPool state):
        cdef Endpoint ep
        cdef long low = 0, ties = 0, k
        cdef Py_ssize_t i, n = len(cands), best = 0
        for i in range(n):
            ep = <Endpoint?>cands[i]
            if i == 0 or ep.inflight < low:
                low, best, ties = ep.inflight, i, 1
            elif ep.inflight == low:
                ties += 1
        if ties > 1:  # the k-th of the tied ones, k at random
            k = self.rng.randrange(ties)
            for i in range(n):
                if (<Endpoint>cands[i]).inflight == low:
                    if k == 0:
                        best = i
                        break
                    k -= 1
        return cands[best], _LOAD
