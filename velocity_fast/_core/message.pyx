"""One parsed HTTP request, compiled: the server makes one per request and the gateway's
request path reads its fields as C struct fields (a msgspec Struct's are attribute
look-ups from compiled code: a type look-up and a descriptor call each).

Python sees the same attributes as before (server/messages.py documents them); the
server and the scanner (http1.pyx) make it with new_request, without an __init__ call.
"""

cimport cython


@cython.freelist(256)  # one per request: reused, not allocated and freed each time
cdef class Request:
    """One parsed HTTP request. Header names are lower case. ``gateway_headers``: False
    when the scanner saw none of the headers the gateway reads on its proxy path
    (x-velocity-*, x-request-id, x-session-id); True when it saw one or did not look."""

    def __init__(self, str method, str path, str query, dict headers, str http_version, bint keep_alive,
                 client, double received_at, bytes body=b"", bint expect_continue=False):
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.client = client
        self.received_at = received_at
        self.body = body
        self.expect_continue = expect_continue
        self.gateway_headers = True  # not known: the gateway looks its headers up

    def header(self, str name, default=None):
        """The value of a header by its lower-case name."""
        return self.headers.get(name, default)

    def __repr__(self):
        return f"<Request {self.method} {self.path} {len(self.body)}B>"


cdef Request new_request(str method, str path, str query, dict headers, str http_version, bint keep_alive,
                         client, double received_at, bytes body):
    cdef Request r = Request.__new__(Request)
    r.method = method
    r.path = path
    r.query = query
    r.headers = headers
    r.http_version = http_version
    r.keep_alive = keep_alive
    r.client = client
    r.received_at = received_at
    r.body = body
    r.gateway_headers = True  # the scanner sets what it found
    return r
