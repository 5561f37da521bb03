# Endpoints and pools, typed: admission, routing and the exchange read their fields as C
# (see endpoint.pyx for the why).


from velocity_fast.state.shm cimport EndpointSlot


cdef class Endpoint:
    cdef public str name
    cdef public str url
    cdef public str model
    cdef public object api_key
    cdef public bint healthy
    cdef public long inflight
    cdef public double running
    cdef public double waiting
    cdef public double kv_usage
    cdef public double scraped_at
    cdef public object num_gpu_blocks
    cdef public object block_size
    cdef public object max_model_len
    cdef public long limit
    cdef public double max_running_seen
    cdef public double running_cap
    # Seconds per output token the engine took over the last second or more of scrapes (its
    # inter-token latency histogram's sum and count, differenced); 0: not known.
    cdef public double pace
    # The most sequences the engine ran at any scrape over that span: at most 1, the pace
    # is its solo pace, the best any concurrency limit can give.
    cdef public double pace_batch
    # Output tokens the engine decoded between its last two scrapes (its inter-token latency
    # histogram's count, differenced): proof that a step ran; -1: not known.
    cdef public double decoded
    # The most this gateway had in flight here while the last scrape was on its way, and
    # what that scrape showed beyond it: other gateways' requests (replicas of this one).
    cdef public long inflight_peak
    cdef public double others
    cdef public double ejected_until
    cdef public double eject_backoff
    cdef public long failures
    cdef public double up_since
    cdef public str state
    cdef public long served
    cdef public long errors
    cdef public object upstream
    # prefill | decode | both: what the engine does in disaggregated serving (gateway/pd.pyx)
    cdef public str role
    # The engine's slot in the workers' shared memory (NULL: one process; state/shm.pxd's
    # inflight_* functions keep ``inflight`` from it)
    cdef EndpointSlot *shm


cdef class Pool:
    cdef public str model
    cdef public list endpoints
    # None: every endpoint does both (the common pool); else the pool's prefill/decode
    # split (gateway/pd.pyx's PdPool), which the front door checks once per request.
    cdef public object pd
    # None without roles; else the endpoints a lease may bind to (role decode or both), set
    # with ``pd``: admission's limits, queue and saturation are over these alone.
    cdef public list decoders

    cpdef long context_length(self, long cap)


cdef class RoomFilter:
    cpdef bint has_room(self, Endpoint ep) except -1


cdef inline list pool_endpoints(pool):
    """A pool's endpoints: a field read for the gateway's Pool, an attribute for another
    (a test's stand-in)."""
    if type(pool) is Pool:
        return (<Pool>pool).endpoints
    eps = pool.endpoints
    return eps if type(eps) is list else list(eps)


cdef inline list lease_endpoints(pool):
    """The endpoints a lease of ``pool`` may bind to: all of them, or with prefill/decode
    roles the ones that decode (a prefill-only engine's slots are no room for a lease)."""
    if type(pool) is Pool and (<Pool>pool).decoders is not None:
        return (<Pool>pool).decoders
    return pool_endpoints(pool)


cdef inline object pool_model(pool):
    if type(pool) is Pool:
        return (<Pool>pool).model
    return pool.model


cdef inline bint same_endpoints(list seen, list eps) except -1:
    """``seen == eps`` for endpoint lists (endpoints compare by identity), without the
    rich comparison: the check that a pool has not changed since it was last looked at."""
    cdef Py_ssize_t i, n
    if seen is eps:
        return True
    if seen is None or eps is None:
        return False
    n = len(seen)
    if n != len(eps):
        return False
    for i in range(n):
        if <object>seen[i] is not <object>eps[i]:
            return False
    return True
