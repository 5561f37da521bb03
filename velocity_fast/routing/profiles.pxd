# The compiled profiles (see profiles.pyx).

from velocity_fast.routing.plugins cimport Profile


cdef class BatchProfile(Profile):
    pass


cdef class LongContextProfile(Profile):
    pass


cdef class ChatProfile(Profile):
    cdef readonly object sessions


cdef class RoundRobinProfile(Profile):
    pass


cdef class LeastLoadedProfile(Profile):
    pass
