"""What routing knows of one request (``RouteInfo``) and of one pool (``RouterPool``).

Records the router fills and the profiles read, compiled so that both read them as C.
"""

from velocity_fast.routing.prefix cimport BlockHashes, PrefixIndex

__all__ = ["RouteInfo", "RouterPool"]


cdef class RouteInfo:
    """What routing needs to know of one request, computed once before it waits."""

    def __init__(self, model, profile, BlockHashes hashes not None, session, session_key):
        self.model = model
        self.profile = profile
        self.hashes = hashes
        self.nblocks = hashes.blocks_of(hashes.n)
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
