# The chat profile's state (see chat.pyx).

from velocity_fast.routing.plugins cimport Profile


cdef class ChatProfile(Profile):
    cdef readonly object sessions
