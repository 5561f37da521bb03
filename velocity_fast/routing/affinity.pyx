# cython: annotation_typing=False
"""The chat profile's rule over affinities already known: precise prefix routing scores
endpoints by their engines' own blocks (routing/precise.py), then picks as
``choose_by_affinity`` does, here in C.

    i, basis = score(affinities, loads, hotspot_gap, load_weight, rand)
"""

from libc.stdint cimport uint64_t

__all__ = ["score"]

# Scores closer than this are a tie (as in prefix.pyx).
cdef double TIE = 1e-9
cdef str _PREFIX = "prefix"
cdef str _LOAD = "load"
cdef str _HOTSPOT = "hotspot"


def score(list aff not None, list loads not None, double hotspot_gap, double load_weight, uint64_t rand):
    """(position, basis): affinity less load_weight per hotspot_gap of load above the
    least; past the gap the least loaded (the most affine among them), basis "hotspot";
    no affinity anywhere: the least loaded, basis "load". Ties go to ``rand``."""
    cdef Py_ssize_t n = len(aff), i, best = 0, ties
    cdef double min_load, top, cost, v, a, x
    cdef bint any_aff = False
    if n == 0 or len(loads) != n:
        raise ValueError("aff and loads must be non-empty and of the same length")
    min_load = <double>loads[0]
    for i in range(n):
        x = <double>loads[i]
        if x < min_load:
            min_load = x
        if <double>aff[i] > 0.0:
            any_aff = True
    if any_aff:
        cost = load_weight / hotspot_gap if hotspot_gap > 0 else load_weight
        top = -1e300
        for i in range(n):
            v = <double>aff[i] - cost * (<double>loads[i] - min_load)
            if v > top:
                top = v
        ties = 0
        for i in range(n):
            if <double>aff[i] - cost * (<double>loads[i] - min_load) >= top - TIE:
                ties += 1
        ties = <Py_ssize_t>(rand % <uint64_t>ties)
        for i in range(n):
            if <double>aff[i] - cost * (<double>loads[i] - min_load) >= top - TIE:
                if ties == 0:
                    best = i
                    break
                ties -= 1
        if <double>loads[best] - min_load <= hotspot_gap:
            return best, _PREFIX
        basis = _HOTSPOT
    else:
        basis = _LOAD
    # The least loaded, the most affine among them.
    top = -1e300
    for i in range(n):
        if <double>loads[i] <= min_load + TIE and <double>aff[i] > top:
            top = <double>aff[i]
    ties = 0
    for i in range(n):
        if <double>loads[i] <= min_load + TIE and <double>aff[i] >= top - TIE:
            ties += 1
    ties = <Py_ssize_t>(rand % <uint64_t>ties)
    for i in range(n):
        if <double>loads[i] <= min_load + TIE and <double>aff[i] >= top - TIE:
            if ties == 0:
                return i, basis
            ties -= 1
    return 0, basis  # not reached
