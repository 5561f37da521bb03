# Endpoints and pools, typed: admission, routing and the exchange read their fields as C
# (see endpoint.pyx for the why).


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
    cdef public long limit
    cdef public double max_running_seen
    cdef public double ejected_until
    cdef public double eject_backoff
    cdef public long failures
    cdef public double up_since
    cdef public str state
    cdef public long served
    cdef public long errors
    cdef public object upstream


cdef class Pool:
    cdef public str model
    cdef public list endpoints


cdef class RoomFilter:
    cdef bint room(self, Endpoint ep) except -1
