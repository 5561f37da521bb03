"""Where a count lives: in this process, in every worker (shared memory), or in every
replica (the state store, Redis).

``bucket`` (compiled): the token bucket (``draw``, ``settle``, ``left``) with its three
homes, ``LocalBucket``, ``ShmBucket`` and ``StoreBucket``, chosen once by ``make_bucket``.
``shm`` (compiled): the segment the workers share and the typed counters in it (an
endpoint's requests in flight, a pool's reservations and queue depths per band, a tenant's
fairness counters); no other module calls its raw operations. ``store``: the Redis side of
the store buckets (the Lua script, the refills, the fallback while Redis is down).
"""
