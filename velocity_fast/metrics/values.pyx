"""The values behind metrics.py's series, compiled: one counter bump or histogram
observation per call, with no Python frame (several happen on every proxied request)."""

from libc.stdlib cimport free, malloc


cdef class Value:
    """One counter or gauge series."""

    def __init__(self):
        self.value = 0.0

    cpdef inc(self, double n=1.0):
        self.value += n

    cpdef dec(self, double n=1.0):
        self.value -= n

    cpdef set(self, double v):
        self.value = v

    cpdef double get(self):
        return self.value


cdef class HistChild:
    """One histogram series: a count per bucket (upper bounds ``bounds``, then +Inf), sum, count."""

    def __cinit__(self, tuple bounds):
        cdef Py_ssize_t i
        self.bounds = bounds
        self._n = len(bounds)
        self._b = <double*>malloc(max(self._n, 1) * sizeof(double))
        self._c = <long long*>malloc((self._n + 1) * sizeof(long long))
        if self._b == NULL or self._c == NULL:
            raise MemoryError()
        for i in range(self._n):
            self._b[i] = bounds[i]
        for i in range(self._n + 1):
            self._c[i] = 0
        self.sum = 0.0
        self.count = 0

    def __dealloc__(self):
        free(self._b)
        free(self._c)

    cpdef observe(self, double v):
        # bisect_left: the first bound >= v (NaN lands in the first bucket, as bisect puts it)
        cdef Py_ssize_t lo = 0, hi = self._n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self._b[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        self._c[lo] += 1
        self.sum += v
        self.count += 1

    @property
    def counts(self):
        """The count of each bucket (not cumulative), +Inf's last."""
        return [self._c[i] for i in range(self._n + 1)]
