# cython: annotation_typing=False
"""The chat profile's rule over affinities already known: precise prefix routing scores
endpoints by their engines' own blocks (scoring.py), then picks as
``choose_by_affinity`` does, with the same compiled rule (prefix.pick_by_affinity).

    i, basis = score(affinities, loads, hotspot_gap, load_weight, rand, waits, hotspot_waiting)
"""

from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc

from velocity_fast.routing.prefix cimport SMALL_POOL, pick_by_affinity

__all__ = ["score"]


def score(list aff not None, list loads not None, double hotspot_gap, double load_weight, uint64_t rand,
          list waits=None, double hotspot_waiting=2.0):
    """(position, basis): affinity less load_weight per hotspot_gap of load above the
    least; an engine that is hot (its queue at hotspot_waiting, or without fresh gauges
    a load past the gap) spills to the best of the others, basis "hotspot"; no affinity
    anywhere: the least loaded, basis "load". Ties go to ``rand``."""
    cdef Py_ssize_t n = len(aff), i
    cdef double *a
    cdef double small[SMALL_POOL]
    cdef bint any_aff = False
    if n == 0 or len(loads) != n or (waits is not None and len(waits) != n):
        raise ValueError("aff, loads and waits must be non-empty and of the same length")
    if n <= SMALL_POOL:
        a = &small[0]
    else:
        a = <double *>malloc(n * sizeof(double))
    if a == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            a[i] = <double>aff[i]
            if a[i] > 0.0:
                any_aff = True
        return pick_by_affinity(a, any_aff, loads, waits, n, hotspot_gap, load_weight, hotspot_waiting, rand)
    finally:
        if a != &small[0]:
            free(a)
