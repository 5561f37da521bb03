# Prefix block hashes straight from request bytes, for compiled callers (see blockscan.pyx).

from velocity_fast.routing.prefix cimport BlockHashes, PrefixHasher

cpdef BlockHashes hash_body(object body, PrefixHasher hasher, str model)
cpdef BlockHashes hash_messages(object messages, PrefixHasher hasher, str model)
cpdef BlockHashes hash_json(object value, PrefixHasher hasher, str model, bint compact=*)
