# cython: annotation_typing=False
"""The router: where a request runs. Filter -> score -> pick (docs/design.md, "Dispatch and the answer").

    router = Router(settings, registry=reg)
    info = router.route_info(model, body_obj, headers)   # profile, prefix hashes, session
    ep = router.pick(pool, info, has_room, exclude=())   # None when no endpoint qualifies
    router.on_dispatch(ep, info)                         # remember the blocks sent to ep

Each step is a class of the interface in plugins.pxd, called as C. Filters (filters.pyx,
asked in order): unhealthy endpoints, endpoints without room (``has_room(ep)`` False: at
their concurrency limit), excluded ones, saturated ones (engine queue or KV usage past
the thresholds) and full ones. When saturation alone would remove every endpoint, the
saturated ones stay (fail open): admission already decided that this request goes now,
and refusing here would only turn a slow answer into an error. Full endpoints (the batch
admission learned for them all in flight, ``Endpoint.running_cap``) come second: a band
never held back, such as ``high``, may go past an engine's batch, and there it would
wait in the engine's FIFO behind the whole batch while another engine could run it at
once. Then the request's profile (``Profile.choose``) scores what is left and picks.

Load (load.pyx) is the engine's waiting count plus the gateway's own in-flight count.
Engine gauges older than ``metrics_stale_s`` (or never scraped) are ignored: the
in-flight count stands alone and nobody is filtered as saturated on stale evidence.

One prefix index per pool (at most 64 endpoints with affinity each); the chains are
seeded by the model name, so pools never share hashes. Pass ``route_info`` the model
of the pool the request will use (the default pool's model when the body names none).
The index only knows what this gateway sent: call ``forget(name)`` when an engine
restarted (its cache is empty) or left the configuration. ``x-session-id`` is honoured
by the chat profile (the one that favours affinity); the other profiles ignore it.

Prefix modes (``routing.prefix``, per model): ``approximate`` is the index above;
``off`` hashes no prompt (the chat profile weighs load alone); ``precise`` also hands
the request to the gateway's token side (``precise=``, routing/precise/), which the
chat profile then asks to score it. With every pool approximate ``route_info`` reads
one flag more than it did.

The request path (``route_info``, ``pick``, ``on_dispatch``) is typed C: what every request
touches is the request's ``RouteInfo`` (profile, prefix block hashes, session), the
filters of ``pick`` (health, room, exclusions, saturation on fresh gauges, fail open) and
the prefix index's bookkeeping of ``on_dispatch``. Construction, ``forget``, ``hit_ratio``
and ``stats`` run once or per scrape and are plain ``def`` methods of the same class.
Endpoints are compiled too (fleet/endpoint.pyx): their fields are read as C, and so are
``RouteInfo`` and ``RouterPool`` by the filters and the profiles.
"""

import random
import time

import msgspec

from velocity_fast.metrics.registry import SUM, Registry, ratio

from cpython.object cimport PyObject

from velocity_fast.lowlevel.clock cimport event_now
from velocity_fast.lowlevel.slots cimport slot_offset
from velocity_fast.fleet.endpoint cimport RoomFilter, pool_endpoints, pool_model
from velocity_fast.metrics.values cimport Value
from velocity_fast.routing.blockscan cimport hash_json
from velocity_fast.routing.prefix cimport THIN_AFTER, THIN_FACTOR, BlockDigests, BlockHashes, PrefixHasher, PrefixIndex
from velocity_fast.routing.route cimport RouteInfo, RouterPool
from velocity_fast.routing.plugins cimport DROP, FULL, KEEP, SATURATED, Filter, Pick, Profile
from velocity_fast.routing.load cimport EngineLoad

# Leaf modules of the routing package (they import nothing of the router).
from velocity_fast.routing.blockscan import render_messages
from velocity_fast.routing.prefix_render import prompt_json, render_prompt
from velocity_fast.routing.session import SessionAffinity

from velocity_fast.routing.errors import UnknownProfile
from velocity_fast.routing.filters import make_filters
from velocity_fast.routing.profiles import make_profiles
from velocity_fast.routing.settings import PROFILE_HEADER, PROFILES, SESSION_HEADER, RoutingSettings

__all__ = ["Router"]

BASES = ("prefix", "session", "load", "hotspot", "kv", "only")
# round-robin's picks are decided by the turn alone.
TURN = ("round-robin", "turn")

cdef str _PROFILE_HEADER = PROFILE_HEADER
cdef str _SESSION_HEADER = SESSION_HEADER
cdef str _ONLY = "only"
cdef object _session_key = SessionAffinity.key
cdef object _py_monotonic = time.monotonic
cdef object _Raw = msgspec.Raw


# The request type whose ``messages`` and ``prompt`` slots were found last, and where: the
# gateway's decoded requests are all of one type, so the prompt is read with one load each
# where getattr on a Struct is a type look-up and a descriptor call (about 100 instructions).
cdef object _slots_type = None
cdef object _plain_type = None  # the last type found without both slots (a dict)
cdef Py_ssize_t _messages_at = 0, _prompt_at = 0


cdef inline object _field(body_obj, bint messages):
    """``body_obj.messages`` (or ``.prompt``), None when it has none: read at the slot
    where its type keeps it once that type was seen."""
    global _slots_type, _plain_type, _messages_at, _prompt_at
    cdef PyObject* v
    tp = type(body_obj)
    if tp is not _slots_type:
        if tp is not _plain_type:
            try:
                _messages_at, _prompt_at = slot_offset(tp, "messages"), slot_offset(tp, "prompt")
                _slots_type = tp
            except (TypeError, AttributeError):  # not a Struct of both (a dict, a Struct without them)
                _plain_type = tp
        if tp is _plain_type:
            return getattr(body_obj, "messages" if messages else "prompt", None)
    v = (<PyObject**>((<char*><PyObject*>body_obj) + (_messages_at if messages else _prompt_at)))[0]
    return None if v == NULL else <object>v


cdef inline bint _short_prompt(body_obj, Py_ssize_t block_bytes) except -1:
    """Whether the prompt's JSON text (raw ``messages``, else raw ``prompt``, or the bytes
    already rendered) holds no full block once its last byte is cut (hash_json's text);
    False where it cannot tell without rendering."""
    cdef Py_ssize_t n
    if isinstance(body_obj, bytes):
        return len(<bytes>body_obj) < block_bytes
    raw = _field(body_obj, True)
    if type(raw) is _Raw:
        n = len(raw)
        if n:
            return n <= block_bytes
    raw = _field(body_obj, False)
    if type(raw) is not _Raw:
        return False
    return len(raw) <= block_bytes


cdef inline RouteInfo _new_info(model, profile, BlockHashes hashes, session, session_key):
    cdef RouteInfo info = RouteInfo.__new__(RouteInfo)
    info.model = model
    info.profile = profile
    info.hashes = hashes
    info.nblocks = hashes.blocks_of(hashes.n)
    info.session = session
    info.session_key = session_key
    return info


cdef class Router:
    """Filter, score and pick an endpoint of a pool for a request: see the module doc."""

    def __cinit__(self):
        self._clock_fn = _py_monotonic
        self._mono = True

    def __init__(self, settings: RoutingSettings | None = None, *, registry: Registry | None = None,
                 rng: random.Random | None = None, precise=None) -> None:
        self.settings = s = settings or RoutingSettings()
        # The token side of precise pools (routing/precise/), owned by the gateway.
        self._precise = precise
        self._rng = rng or random.Random(s.seed)
        self._hasher = PrefixHasher(s.block_bytes)
        self._hashless_infos = {}  # by model: nothing per request in them
        self._short_infos = {}  # the same for prompts shorter than one block, by (model, profile)
        self._sessions = SessionAffinity()
        self._profiles = make_profiles(s, self._rng, self._sessions)
        # What each profile reads, as it declares it: the request path asks these, not names.
        self._hashless = frozenset(n for n, p in self._profiles.items() if not p.needs_prefix)
        self._precise_profiles = frozenset(n for n, p in self._profiles.items() if p.precise)
        self._pickst = Pick()
        self._load = EngineLoad()
        self._pools = {}  # model -> RouterPool
        self._clock = time.monotonic
        reg = registry if registry is not None else Registry()
        # Each worker routes its own requests and keeps its own index: its share, summed.
        self._picks = reg.counter("velocity_route_picks_total",
                                  "Endpoint picks by routing profile and what decided them.",
                                  ("profile", "basis"), merge=SUM)
        self._pick_children = {(p, b): self._picks.labels(p, b) for p in PROFILES for b in BASES}
        self._pick_children[TURN] = self._picks.labels(*TURN)
        for name, p in self._profiles.items():
            (<Profile?>p).picks = {b: child for (n, b), child in self._pick_children.items() if n == name}
            (<Profile>p).only = (<Profile>p).picks[_ONLY]
        self._fail_open = reg.counter("velocity_route_fail_open_total",
                                      "Picks made among saturated endpoints because all were saturated.", merge=SUM)
        self._full = reg.counter("velocity_route_full_total",
                                 "Picks made among endpoints whose learned batch was all in flight, "
                                 "because none could run the request at once.", merge=SUM)
        self._no_endpoint = reg.counter("velocity_route_no_endpoint_total",
                                        "Picks that found no healthy endpoint with room.", merge=SUM)
        self._blocks_sent = reg.counter("velocity_prefix_blocks_total",
                                        "Prompt blocks dispatched (prefix hashing units).", merge=SUM)
        self._blocks_hit = reg.counter("velocity_prefix_hit_blocks_total",
                                       "Leading prompt blocks the chosen endpoint had recently been sent.", merge=SUM)
        reg.gauge_fn("velocity_prefix_index_hit_ratio",
                     "Prefix-index hit ratio: hit blocks / dispatched blocks.", self.hit_ratio,
                     merge=ratio("velocity_prefix_hit_blocks_total", "velocity_prefix_blocks_total"))
        reg.gauge_fn("velocity_prefix_index_blocks", "Block hashes held in the prefix index, per model.",
                     lambda: [((m, ), len(st.index)) for m, st in self._pools.items()], ("model",),
                     merge=SUM)
        self._configure()

    # -- lifecycle and visibility -----------------------------------------------

    def forget(self, name: str, model: str | None = None) -> None:
        """Drop what the index remembers of an endpoint (it left the configuration)."""
        for m, state in self._pools.items():
            if model is None or m == model:
                state.index.remove(name)
                state.caps.pop(name, None)
        if self._precise is not None:
            self._precise.forget(name)

    def hit_ratio(self) -> float:
        """Dispatched prompt blocks that the chosen endpoint already held, as a fraction."""
        sent = self._blocks_sent.get()
        return self._blocks_hit.get() / sent if sent else 0.0

    def stats(self) -> dict:
        """Picks by profile and basis, filter outcomes, and the prefix index sizes."""
        picks: dict[str, dict[str, int]] = {}
        for (p, b), child in self._pick_children.items():
            if child.value:
                picks.setdefault(p, {})[b] = int(child.value)
        return {
            "picks": picks,
            "fail_open": int(self._fail_open.get()),
            "full": int(self._full.get()),
            "no_endpoint": int(self._no_endpoint.get()),
            "prefix_index": {
                "hit_ratio": round(self.hit_ratio(), 4),
                "blocks_sent": int(self._blocks_sent.get()),
                "blocks_hit": int(self._blocks_hit.get()),
                "block_bytes": self.settings.block_bytes,
                "pools": {m: st.index.stats() for m, st in self._pools.items()},
            },
        }

    def _configure(self):
        """Read the settings and metric children the request path uses (the settings are
        frozen; call again after replacing them)."""
        s = self.settings
        self._pickst.stale_s = s.metrics_stale_s
        self._filters = make_filters(s)
        self._model_profiles = s.profiles
        self._default_profile = s.default_profile
        self._fail_open_v = self._fail_open.labels()
        self._full_v = self._full.labels()
        self._no_endpoint_v = self._no_endpoint.labels()
        self._blocks_sent_v = self._blocks_sent.labels()
        self._blocks_hit_v = self._blocks_hit.labels()
        self._prefix_modes = dict(s.prefix_modes)
        self._prefix_default = s.prefix
        self._plain_prefix = s.prefix == "approximate" and all(m == "approximate" for m in s.prefix_modes.values())

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
            return event_now()
        return self._clock_fn()

    cdef RouterPool _pool_state(self, model, pool):
        # The last model's state kept: one pool (or a run of requests to one) needs no
        # look-up by model on each pick.
        if model is self._state_model and self._state_last is not None:
            return self._state_last
        st = self._pools.get(model)
        if st is None:
            st = self._pools[model] = RouterPool(pool, self.settings)
        self._state_model = model
        self._state_last = <RouterPool?>st
        return self._state_last

    # -- per request -------------------------------------------------------------

    cpdef RouteInfo route_info(self, model, body_obj, headers, bint compact=False, digests=None):
        """Profile, prefix block hashes and session of a request.

        body_obj is the decoded body (dict or Struct with `messages` or `prompt`), or the
        prompt bytes already rendered. digests: the BlockDigests the request scanner made
        of its prompt (gateway/requests.pyx), chained here instead of hashing the prompt
        again. Raises UnknownProfile for a bad x-velocity-profile.
        """
        cdef RouteInfo info
        cdef bint by_model = True
        model = model or ""
        if (headers is None or not headers) and model is self._last_model \
                and self._model_profiles is self._last_profiles:
            # The usual request: the same model as the last, no routing headers. Batch needs
            # no prompt; a prompt shorter than one block has none to route by.
            if not self._last_short or _short_prompt(body_obj, self._hasher.block_bytes):
                return self._last_info
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
                raise UnknownProfile(profile)
            by_model = False
        else:
            profile = self._model_profiles.get(model, self._default_profile)
        if session:
            session = session.strip() or None
        if not session and profile in self._hashless:
            # A profile that needs no prefix (batch's shortest queue): no rendering, no
            # hashing, one shared RouteInfo.
            info = self._hashless_infos.get(model)
            if info is None:
                info = _new_info(model, profile, self._hasher.hash(b"", model), None, None)
                if len(self._hashless_infos) < 256:  # models come from clients: the cache stays bounded
                    self._hashless_infos[model] = info
            if by_model:
                # What decided it is the model and the profiles it maps to: the next request
                # with the same model object and no routing headers gets the same info.
                self._last_model = model
                self._last_info = info
                self._last_profiles = self._model_profiles
                self._last_short = False
            return info
        if not self._plain_prefix:
            return self._route_info_modes(model, profile, body_obj, session)
        if not session and _short_prompt(body_obj, self._hasher.block_bytes):
            # No full block to hash (the hashed text is at most the JSON less one byte): the
            # same empty prefix for every such prompt, one shared RouteInfo as batch's.
            key = (model, profile)
            info = self._short_infos.get(key)
            if info is None:
                info = _new_info(model, profile, self._hasher.hash(b"", model), None, None)
                if len(self._short_infos) < 256:
                    self._short_infos[key] = info
            if by_model:
                self._last_model = model
                self._last_info = info
                self._last_profiles = self._model_profiles
                self._last_short = True
            return info
        cdef BlockHashes hashes
        if isinstance(body_obj, (bytes, bytearray, memoryview)):
            hashes = self._hasher.hash(body_obj, model)
        else:
            # The prompt's JSON text as the client wrote it, hashed where it lies: the
            # request decoder keeps messages and prompt raw (gateway/requests.pyx).
            raw = _field(body_obj, True)
            is_prompt = False
            if type(raw) is not _Raw or not len(raw):
                is_prompt = True
                raw = _field(body_obj, False)
                if type(raw) is not _Raw:
                    raw = prompt_json(body_obj)  # a dict, /generate's request: encoded
            hashes = None
            if digests is not None and compact and self._hasher.block_bytes == 64:
                # Digested as the scanner validated it: chained from the model's seed, and
                # thinned as they are made.
                hashes = (<BlockDigests?>digests).hashes_for(raw, is_prompt, self._hasher.seed_for(model))
            if hashes is None:
                hashes = hash_json(raw, self._hasher, model, compact)
        hashes.thin(THIN_AFTER, THIN_FACTOR)  # a long prompt's tail in coarse steps (no-op when thinned)
        return _new_info(model, profile, hashes, session,
                         _session_key(session) if session else None)

    cdef RouteInfo _route_info_modes(self, model, profile, body_obj, session):
        """route_info's end where some pool is not approximate: off renders and hashes nothing
        (the chat profile then weighs load alone); precise also asks for the prompt's tokens."""
        cdef RouteInfo info
        cdef BlockHashes hashes
        mode = self._prefix_modes.get(model, self._prefix_default)
        if mode == "off":
            data = b""
        elif isinstance(body_obj, (bytes, bytearray, memoryview)):
            data = body_obj
        else:
            # Precise routing tokenizes the rendered prompt: the compiled renderer reads
            # the raw messages; what it does not take is rendered in Python, to the same bytes.
            data = None
            raw = getattr(body_obj, "messages", None)
            if type(raw) is _Raw and len(raw):
                data = render_messages(raw)
            if data is None:
                data = render_prompt(body_obj)
        hashes = self._hasher.hash(data, model)
        if mode == "approximate":
            hashes.thin(THIN_AFTER, THIN_FACTOR)
        info = _new_info(model, profile, hashes, session, _session_key(session) if session else None)
        if mode == "precise" and self._precise is not None and profile in self._precise_profiles:
            self._precise.attach(info, body_obj, data)
        return info

    cpdef object pick(self, pool, RouteInfo info, has_room=None, exclude=()):
        """The endpoint of pool for this request, or None when none is healthy with room.

        has_room(ep): room for this request on ep (a RoomFilter is asked as C); None: room
        everywhere. exclude: endpoints not to use (those a retry already failed on)."""
        cdef RouterPool state
        cdef Pick pk = self._pickst
        cdef Profile profile
        cdef double load, first_load = 0.0
        cdef int verdict
        cdef list cands = None, loads = None
        cdef list saturated = None, saturated_loads = None, full = None, full_loads = None
        cdef Endpoint ep, first = None
        if info is None:
            raise TypeError("pick needs the request's RouteInfo, not None")
        state = self._pool_state(pool_model(pool), pool)
        if state.pool is not pool:  # made by on_dispatch, or the pool was replaced
            state.pool = pool
        pk.now = self._now()
        pk.has_room = has_room
        pk.room_filter = has_room if isinstance(has_room, RoomFilter) else None
        pk.exclude = exclude
        try:
            for ep in pool_endpoints(pool):
                # The filters in order (filters.pyx): the first that does not keep ep decides.
                verdict = KEEP
                for f in self._filters:
                    verdict = (<Filter>f).check(ep, pk)
                    if verdict != KEEP:
                        break
                if verdict == DROP:
                    continue
                load = self._load.score(ep, pk)
                if verdict == SATURATED:
                    if saturated is None:
                        saturated, saturated_loads = [], []
                    saturated.append(ep)
                    saturated_loads.append(load)
                    continue
                if verdict == FULL:
                    # A request sent there waits in the engine's FIFO behind its batch: kept
                    # for when no engine would run it at once.
                    if full is None:
                        full, full_loads = [], []
                    full.append(ep)
                    full_loads.append(load)
                    continue
                # The lists are made only when a second candidate comes (one is the common pool).
                if first is None:
                    first, first_load = ep, load
                    continue
                if cands is None:
                    cands, loads = [first], [first_load]
                cands.append(ep)
                loads.append(load)
        finally:
            # The pick holds no request's objects past its end.
            pk.has_room = pk.room_filter = None
            pk.exclude = ()
        if first is None:
            if full:
                cands, loads = full, full_loads
                self._full_v.value += 1.0
            elif not saturated:
                self._no_endpoint_v.value += 1.0
                return None
            else:
                cands, loads = saturated, saturated_loads
                self._fail_open_v.value += 1.0
            first = cands[0]
            if len(cands) == 1:
                cands = None
        if info.profile is not self._profile_name or self._profile_last is None:
            self._profile_last = <Profile>self._profiles[info.profile]
            self._profile_name = info.profile
        profile = self._profile_last
        if cands is None or len(cands) == 1:
            profile.only.value += 1.0  # a pick without a choice
            return first if cands is None else cands[0]
        chosen = cands[profile.choose(cands, loads, info, state)]
        (<Value>profile.picks[profile.basis]).value += 1.0
        return chosen

    def profile(self, name):
        """The profile called ``name``, or None: its ``basis`` says what decided its last
        choice (a trace reads it; a pick with one candidate makes no choice)."""
        return self._profiles.get(name)

    cpdef double cached_room(self, pool, RouteInfo info) except? -1.0:
        """The largest fraction of ``info``'s prompt blocks that an endpoint of ``pool``
        with room (healthy, in-flight below its limit) was sent recently, 0 to 1: what
        admission's locality fairness asks of a queued request (the approximate index)."""
        cdef RouterPool state
        cdef PrefixIndex index
        cdef Endpoint ep
        cdef list matched = None
        cdef Py_ssize_t best = 0, m
        cdef int s
        if info is None or not info.nblocks:
            return 0.0
        state = self._pools.get(pool_model(pool))
        if state is None:
            return 0.0
        index = state.index
        for ep in pool_endpoints(pool):
            if not ep.healthy or ep.inflight >= ep.limit:
                continue
            s = index.slot_of(ep.name)
            if s < 0:
                continue
            if matched is None:
                matched = index.match(info.hashes)
            if s < len(matched):
                m = matched[s]
                if m > best:
                    best = m
        return min(1.0, <double>best / info.nblocks)

    cdef Py_ssize_t _matched(self, key, RouteInfo info, Endpoint ep) except -1:
        """``info``'s leading prompt blocks that the approximate index of the pool ``key``
        says ``ep`` was sent recently (0: none, or a request with no blocks)."""
        cdef RouterPool state
        cdef PrefixIndex index
        cdef int s
        if info is None or not info.nblocks:
            return 0
        state = self._pools.get(key)
        if state is None:
            return 0
        index = state.index
        s = index.slot_of(ep.name)
        if s < 0:
            return 0
        matched = index.match(info.hashes)
        return <Py_ssize_t>matched[s] if s < len(matched) else 0

    cpdef double cached_on(self, pool, RouteInfo info, Endpoint ep) except? -1.0:
        """The fraction of ``info``'s prompt blocks that ``ep`` was sent recently, 0 to 1
        (the approximate index): how much of the prompt a disaggregation decider may take
        as cached there (gateway/pd.pyx)."""
        if info is None or not info.nblocks:
            return 0.0
        return min(1.0, <double>self._matched(pool_model(pool), info, ep) / info.nblocks)

    def matched_blocks(self, Endpoint ep, RouteInfo info):
        """How many of ``info``'s leading prompt blocks the prefix index says ``ep`` was sent
        recently (0: none, or a request with no blocks); what a trace shows of a pick."""
        return self._matched(ep.model, info, ep)

    def kv_blocks_held(self, Endpoint ep, RouteInfo info):
        """(the prompt's token blocks, how many of them ``ep``'s engine holds as its KV
        events say, -1 where its index is not exact), or None: not a precise request, or
        its tokens not ready; what a trace shows of a precise pick."""
        pr = info.precise if info is not None else None
        if pr is None or self._precise is None or pr.chain is None:
            return None
        return len(pr.chain), self._precise.index.match_exact(ep.name, pr.chain, pr.block_size)

    cpdef void on_dispatch(self, Endpoint ep, RouteInfo info) except *:
        """Remember that info's prompt blocks were sent to ep (call once it is bound)."""
        cdef Py_ssize_t n, held
        cdef RouterPool state
        cdef PrefixIndex index
        if info is None:
            raise TypeError("on_dispatch needs the request's RouteInfo, not None")
        n = info.nblocks
        pr = info.precise
        if pr is not None and self._precise is not None:
            self._precise.dispatched(ep.name, pr)
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
