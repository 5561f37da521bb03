"""Endpoints (one engine each) and pools (the endpoints serving one model), compiled.

Admission, the router and the exchange read an endpoint's counts and gauges several
times per request (healthy, in flight, limit, the scraped gauges): as fields of a
typed class these are C struct reads, where a Python object's slots cost a type
lookup and a descriptor call each. The health monitor and the scraper, which write
them once per check or scrape, use them as ordinary attributes.
"""

from velocity_fast.lowlevel.clock cimport monotonic
from velocity_fast.state.shm cimport endpoint_slot

# Endpoint.snapshot()'s numbers that every worker reports whole (the shared in-flight and
# limit, the engine's scrape): several workers' /stats take the largest (gateway/stats_merge.py).
STATS_WHOLE = frozenset({"inflight", "limit", "running", "waiting", "kv_usage", "metrics_age_s", "num_gpu_blocks"})


cdef class Endpoint:
    """What the gateway knows of one engine. See docs/internals.md."""

    def __init__(self, str name, str url, str model, *, api_key=None, long limit=32, str role="both"):
        self.name = name
        self.role = role
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.healthy = False          # set by the first good health check
        self.num_gpu_blocks = None
        self.block_size = None
        self.max_model_len = None     # the engine's, from its /v1/models once healthy
        self.limit = limit
        self.decoded = -1.0           # tokens decoded between the last two scrapes; -1: unknown
        # max_running_seen: high-water mark of observed running, the learned batch capacity
        # running_cap: the batch admission learned from the gauges (the most seen running,
        # once two scrapes in a row showed a queue beside it); 0: not known
        # inflight_peak, others: see saturation.pyx's observe_endpoint
        self.state = "unknown"        # unknown | healthy | ejected | down | unserved
        self.upstream = None          # the UpstreamPool, set by the gateway
        # With workers, ``inflight`` counts every worker's requests (admission keeps it
        # from the shared slot); one process: NULL, its own count.
        self.shm = endpoint_slot(name)

    def metrics_age(self, now=None):
        if not self.scraped_at:
            return float("inf")
        return (now or monotonic()) - self.scraped_at

    def snapshot(self):
        return {"name": self.name, "url": self.url, "model": self.model, "state": self.state,
                "healthy": self.healthy, "inflight": self.inflight, "limit": self.limit,
                "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage,
                "metrics_age_s": round(self.metrics_age(), 3) if self.scraped_at else None,
                "num_gpu_blocks": self.num_gpu_blocks, "served": self.served, "errors": self.errors,
                "role": self.role}

    def __repr__(self):
        return f"<Endpoint {self.name} {self.url} {self.model} {self.state} inflight={self.inflight}>"


cdef class Pool:
    """The endpoints that serve one model."""

    def __init__(self, str model, list endpoints=None):
        self.model = model
        self.endpoints = endpoints or []

    def healthy(self):
        return [e for e in self.endpoints if (<Endpoint>e).healthy]

    cpdef long context_length(self, long cap):
        """The longest prompt + completion every healthy engine of the pool accepts: the
        smallest ``max_model_len`` they reported, at most ``cap`` (the gateway's own)."""
        cdef Endpoint e
        cdef long n = cap
        for x in self.endpoints:
            e = <Endpoint>x
            if e.healthy and e.max_model_len is not None and <long>e.max_model_len < n:
                n = <long>e.max_model_len
        return n


cdef class RoomFilter:
    """A router's filter of endpoints asked as C (an admission lease is one); any other
    filter is a Python callable taking the endpoint."""

    cpdef bint has_room(self, Endpoint ep) except -1:
        """Room on ``ep`` for the request (this base: everywhere)."""
        return True

    def __call__(self, Endpoint ep):
        return self.has_room(ep)
