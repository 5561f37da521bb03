# Decoding client requests, what compiled callers call as C (see requests.pyx for the why).

cpdef decode_proxy(bytes body, bint chat)
cpdef bytes strip_own_fields(bytes body, r)
