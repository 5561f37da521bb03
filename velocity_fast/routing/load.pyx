# cython: annotation_typing=False
"""The load of an endpoint, in requests: the scorer every profile weighs (plugins.pyx,
``Scorer``). The engine's waiting count plus this gateway's in flight there; engine gauges
older than ``metrics_stale_s`` (or never scraped) are ignored, the in-flight count stands alone.
"""

from velocity_fast.fleet.endpoint cimport Endpoint
from velocity_fast.routing.plugins cimport Pick, Scorer, gauges_fresh

__all__ = ["EngineLoad"]


cdef class EngineLoad(Scorer):
    """Engine waiting (on fresh gauges) + gateway in flight."""

    name = "load"

    cpdef double score(self, Endpoint ep, Pick pick) except? -1.0:
        if gauges_fresh(ep, pick.now, pick.stale_s):
            return ep.waiting + <double>ep.inflight
        return <double>ep.inflight
