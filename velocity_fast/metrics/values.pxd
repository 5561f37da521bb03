cdef class Value:
    cdef public double value

    cpdef inc(self, double n=*)
    cpdef dec(self, double n=*)
    cpdef set(self, double v)
    cpdef double get(self)


cdef class HistChild:
    cdef readonly tuple bounds
    cdef Py_ssize_t _n
    cdef double* _b
    cdef long long* _c
    cdef public double sum
    cdef public long long count

    cpdef observe(self, double v)
