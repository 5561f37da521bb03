# The router's request path, typed (see router.pyx for the why).

from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.metrics.values cimport Value
from velocity_fast.routing.prefix cimport BlockHashes, PrefixHasher, PrefixIndex
from velocity_fast.routing.route cimport RouteInfo, RouterPool
from velocity_fast.routing.load cimport EngineLoad
from velocity_fast.routing.plugins cimport Pick, Profile


cdef class Router:
    cdef public object settings
    cdef public object _rng
    cdef public object _sessions
    cdef public PrefixHasher _hasher
    cdef public dict _profiles
    cdef public dict _pools
    cdef public dict _hashless_infos  # by model: the RouteInfo of a profile that needs no prefix
    cdef public dict _pick_children
    cdef object _last_model  # the last shared RouteInfo, for the same model and profiles
    cdef RouteInfo _last_info
    cdef object _last_profiles
    cdef bint _last_short    # _last_info is for prompts shorter than one block (else: a hashless profile's)
    cdef dict _short_infos   # (model, profile) -> the RouteInfo of a prompt without a full block
    cdef public object _picks
    cdef public object _fail_open
    cdef public object _no_endpoint
    cdef public object _full
    cdef public object _blocks_sent
    cdef public object _blocks_hit
    cdef object _clock_fn
    cdef bint _mono
    # Settings and metric children read on every request (set by _configure).
    cdef object _state_model      # the model _state_last is the RouterPool of (pools are never replaced)
    cdef RouterPool _state_last
    cdef object _profile_name     # the profile name _profile_last is (profiles are made once)
    cdef Profile _profile_last
    cdef tuple _filters     # filters.pyx's, in order
    cdef EngineLoad _load   # the candidates' load, which the profiles weigh
    cdef Pick _pickst       # refilled by each pick
    cdef dict _model_profiles
    cdef object _default_profile
    cdef Value _fail_open_v
    cdef Value _full_v
    cdef Value _no_endpoint_v
    cdef Value _blocks_sent_v
    cdef Value _blocks_hit_v
    # Prefix modes (routing.prefix): all approximate is the plain path.
    cdef public object _precise
    cdef frozenset _hashless          # the profiles that need no prefix (Profile.needs_prefix)
    cdef frozenset _precise_profiles  # the profiles a precise pool hands to the token side (Profile.precise)
    cdef bint _plain_prefix
    cdef dict _prefix_modes
    cdef object _prefix_default

    cdef double _now(self) except? -1.0
    cdef RouterPool _pool_state(self, model, pool)
    cpdef RouteInfo route_info(self, model, body_obj, headers, bint compact=*, digests=*)
    cdef RouteInfo _route_info_modes(self, model, profile, body_obj, session)
    cpdef object pick(self, pool, RouteInfo info, has_room=*, exclude=*)
    cpdef void on_dispatch(self, Endpoint ep, RouteInfo info) except *
    cpdef double cached_room(self, pool, RouteInfo info) except? -1.0
    cdef Py_ssize_t _matched(self, key, RouteInfo info, Endpoint ep) except -1
    cpdef double cached_on(self, pool, RouteInfo info, Endpoint ep) except? -1.0
