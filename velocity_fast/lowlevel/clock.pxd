# time.monotonic() for compiled code, without a Python call (the same clock on Linux),
# and the time of the I/O event being handled (clock.pyx).

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef double event_begin() noexcept
cdef void event_end(double prev) noexcept
cdef double event_now() noexcept
