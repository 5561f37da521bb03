# State and signatures of prefix hashing and the prefix index (see prefix.pyx for the why).

from libc.stdint cimport uint32_t, uint64_t


cdef extern from "prefix_hash.h":
    size_t VP_STRIPE
    size_t vp_hash_blocks(const unsigned char *data, size_t length, size_t block,
                          uint64_t seed, uint64_t *out) nogil
    uint64_t vp_hash_bytes(const unsigned char *data, size_t length, uint64_t seed) nogil
    int vp_digest_block_isa(const unsigned char *p, size_t n, int isa, uint64_t *out) nogil
    uint64_t vp_rendezvous(uint64_t key, uint64_t node) nogil
    uint64_t vp_step(uint64_t state, uint64_t digest) nogil
    uint64_t vp_avalanche(uint64_t h) nogil


cdef extern from "prefix_index.h":
    int VP_MAX_SLOTS

    ctypedef struct vp_lru:
        uint64_t count
        uint64_t capacity
        uint64_t keys

    ctypedef struct vp_index:
        uint64_t ents_used
        uint64_t ents_mask
        uint64_t refs_mask
        uint64_t nodes_cap
        uint64_t live
        vp_lru lru[64]

    int vp_index_init(vp_index *ix) nogil
    void vp_index_free(vp_index *ix) nogil
    size_t vp_head_run(const vp_index *ix, uint32_t slot, const uint64_t *keys, size_t n) nogil
    int vp_touch_chain(vp_index *ix, uint32_t slot, const uint64_t *keys, size_t n,
                       size_t fine, uint32_t coarse, uint32_t tail, size_t run) nogil
    size_t vp_leading_held(const vp_index *ix, uint32_t slot, const uint64_t *keys, size_t n) nogil
    void vp_set_capacity(vp_index *ix, uint32_t slot, uint64_t capacity) nogil
    void vp_match(const vp_index *ix, const uint64_t *keys, size_t n, uint64_t alive,
                  uint32_t *out) nogil
    void vp_lru_keys(const vp_index *ix, uint32_t slot, uint64_t *out, size_t cap) nogil


# A long prompt's chain is thinned (BlockHashes.thin) past its first THIN_AFTER blocks to
# every THIN_FACTOR-th: 4 KiB in 64-byte blocks, then 1 KiB steps.
cdef enum:
    THIN_AFTER = 64
    THIN_FACTOR = 16

# Candidates up to this many are scored in arrays on the stack (more: malloc).
cdef enum:
    SMALL_POOL = 16


cdef class BlockHashes:
    cdef uint64_t *keys
    cdef readonly Py_ssize_t n
    cdef readonly uint64_t seed
    cdef readonly Py_ssize_t block_bytes
    # Thinned (thin()): the first `fine` hashes are one block each, the rest `coarse`
    # blocks each, but the last `tail` blocks when not 0 (the blocks after the last whole
    # step); coarse 0 or 1: every hash is one block.
    cdef readonly Py_ssize_t fine
    cdef readonly Py_ssize_t coarse
    cdef readonly Py_ssize_t tail
    cdef void thin(self, Py_ssize_t after, Py_ssize_t factor) noexcept
    cdef Py_ssize_t blocks_of(self, Py_ssize_t m) noexcept


cdef class BlockDigests:
    # The digests of one prompt member's 64-byte blocks, made by the request scanner as it
    # validated them (csrc/reqscan.h, vr_digests); d has room for cap.
    cdef uint64_t *d
    cdef uint64_t *s  # the chain's states from guess, one a digest
    cdef uint64_t guess
    cdef Py_ssize_t n
    cdef Py_ssize_t cap
    cdef readonly Py_ssize_t length  # bytes of the member's value (its compact JSON text)
    cdef readonly bint prompt  # the member is `prompt` (else `messages`)
    cdef BlockHashes hashes_for(self, object raw, bint prompt, uint64_t seed)


cdef BlockDigests new_digests(Py_ssize_t cap)
cdef uint64_t digest_seed() noexcept


cdef class PrefixHasher:
    cdef readonly Py_ssize_t block_bytes
    cdef dict _seeds
    cpdef uint64_t seed_for(self, str model) except? 0
    cpdef BlockHashes hash(self, object data, str model)


cdef class PrefixIndex:
    cdef vp_index _ix
    cdef bint _ready
    cdef readonly uint64_t default_capacity
    cdef dict _slots
    cdef list _names
    cdef uint64_t _active
    cdef uint32_t _matched[64]
    cpdef int slot(self, object name) except -2
    cpdef int slot_of(self, object name)
    cpdef Py_ssize_t touch(self, object name, BlockHashes hashes) except -1
    cpdef list match(self, BlockHashes hashes)


cdef tuple pick_by_affinity(double *aff, bint any_affinity, list loads, list waits, Py_ssize_t nc,
                            double hotspot_gap, double load_weight, double hotspot_waiting,
                            uint64_t rand)
