"""Prefix affinity, compiled: chained block hashes of a prompt and the per-endpoint index.

A prompt's bytes are cut into blocks of ``block_bytes`` (default 64: at about 4 bytes a
token that is one 16-token vLLM KV block); each full block is hashed and chained with
its parent, seeded by the model name (csrc/prefix_hash.h). Only full blocks are hashed,
as vLLM caches only full blocks: a trailing partial block would never be shared between
requests, and its hash would change as soon as the prompt grows, so indexing it would
only push useful entries out of the LRU.

The index (csrc/prefix_index.h) remembers, per endpoint ("slot", at most 64 per index),
the block hashes recently sent there, in an LRU bounded per endpoint; one pass over a
prompt's hashes gives the matched leading blocks of every endpoint at once.

The chat profile's scoring (affinity against load, the hot-spot guard) runs here too,
as ``choose_by_affinity``: it is per-request math over the index's match, and in
Python it would cost more than the match itself. Nothing here knows asyncio; an
endpoint is any object with a ``name`` (the index key).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from libc.math cimport INFINITY
from libc.stdlib cimport free, malloc

MAX_SLOTS = VP_MAX_SLOTS
STRIPE_BYTES = VP_STRIPE
# Approximate routing thins a chain past its first THIN_AFTER blocks to every
# THIN_FACTOR-th (BlockHashes.thin).
THIN_BLOCKS_AFTER = THIN_AFTER
THIN_BLOCKS_FACTOR = THIN_FACTOR

# Scores closer than this are a tie: float noise must not defeat the random tie-break.
cdef double TIE_EPS = 1e-9


cdef inline uint64_t _hash_obj(object data, uint64_t seed) except? 0:
    cdef Py_buffer view
    cdef uint64_t h
    if isinstance(data, str):
        data = (<str>data).encode("utf-8", "surrogatepass")
    if type(data) is bytes:
        return vp_hash_bytes(<const unsigned char *>PyBytes_AS_STRING(data),
                             <size_t>PyBytes_GET_SIZE(data), seed)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        h = vp_hash_bytes(<const unsigned char *>view.buf, <size_t>view.len, seed)
    finally:
        PyBuffer_Release(&view)
    return h


def hash_bytes(data, seed=0):
    """Stable 64-bit hash of bytes (a str is hashed as UTF-8); the same in every process."""
    return _hash_obj(data, <uint64_t>seed)


_DIGEST_ISAS = {"c": 0, "sse2": 1, "avx2": 2}


def block_digest(bytes data, str isa="sse2"):
    """The digest of one block (its length a multiple of STRIPE_BYTES) computed one named
    way: "c" (plain C, as hosts without SIMD take it), "sse2" (every x86-64) or "avx2"
    (what hashing takes where the CPU has it; ValueError where it has not). All must
    agree (for tests): a gateway's keys never depend on the CPU."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef uint64_t out = 0
    if n % <Py_ssize_t>VP_STRIPE:
        raise ValueError(f"a block is a multiple of {VP_STRIPE} bytes, got {n}")
    if isa not in _DIGEST_ISAS:
        raise ValueError(f"isa: {isa!r} is not c, sse2 or avx2")
    if vp_digest_block_isa(<const unsigned char *>PyBytes_AS_STRING(data), <size_t>n,
                           _DIGEST_ISAS[isa], &out) < 0:
        raise ValueError("avx2: not in this build or on this CPU")
    return out


def rendezvous_weight(key, node):
    """Rendezvous (highest random weight) score of a key on a node, both 64-bit hashes."""
    return vp_rendezvous(<uint64_t>key, <uint64_t>node)


cdef class BlockHashes:
    """The chained hashes of a prompt's full blocks (h_i names the prefix up to block i)."""

    def __dealloc__(self):
        free(self.keys)

    @staticmethod
    def of(values, seed=0, block_bytes=64):
        """BlockHashes holding the given 64-bit values (for tests and benchmarks)."""
        cdef BlockHashes out = BlockHashes.__new__(BlockHashes)
        cdef Py_ssize_t i, n = len(values)
        out.keys = <uint64_t *>malloc(max(n, 1) * sizeof(uint64_t))
        if out.keys == NULL:
            raise MemoryError()
        for i in range(n):
            out.keys[i] = <uint64_t>values[i]
        out.n = n
        out.seed = <uint64_t>seed
        out.block_bytes = block_bytes
        return out

    def __len__(self):
        return self.n

    cdef void thin(self, Py_ssize_t after, Py_ssize_t factor) noexcept:
        """Keep the first ``after`` hashes, then every ``factor``-th: a long prompt's tail
        in coarse steps. Each hash still names the whole prefix up to its block, so a
        continuation's thinned chain extends this one's, and an index touches a 256 KiB
        prompt's 316 keys instead of its 4,096 blocks; its weight keeps the capacity in
        blocks. The blocks after the last whole step end in one more hash, which weighs
        them (``tail``): the engine holds them too, so the index counts them; a
        continuation does not match it (its own step there lies further on)."""
        cdef Py_ssize_t i, j, rem
        if factor <= 1 or self.coarse > 1:
            return
        self.fine = after
        self.coarse = factor
        if self.n <= after:
            return
        rem = (self.n - after) % factor
        j = after
        i = after + factor - 1
        while i < self.n:
            self.keys[j] = self.keys[i]
            j += 1
            i += factor
        if rem:
            self.keys[j] = self.keys[self.n - 1]
            j += 1
            self.tail = rem
        self.n = j

    cdef Py_ssize_t blocks_of(self, Py_ssize_t m) noexcept:
        """The blocks the first m hashes stand for."""
        if self.coarse <= 1 or m <= self.fine:
            return m
        if self.tail and m == self.n:
            return self.fine + (m - 1 - self.fine) * self.coarse + self.tail
        return self.fine + (m - self.fine) * self.coarse

    @property
    def blocks(self):
        """The blocks all the hashes stand for (n unless thinned)."""
        return self.blocks_of(self.n)

    def thinned(self, Py_ssize_t after, Py_ssize_t factor):
        """A thinned copy (see thin; for tests and benchmarks)."""
        cdef BlockHashes out = BlockHashes.of(self.tolist(), self.seed, self.block_bytes)
        out.thin(after, factor)
        return out

    def __getitem__(self, Py_ssize_t i):
        if i < 0:
            i += self.n
        if i < 0 or i >= self.n:
            raise IndexError("block index out of range")
        return self.keys[i]

    def tolist(self):
        """The hashes as a list of ints."""
        return [self.keys[i] for i in range(self.n)]

    def __repr__(self):
        return f"<BlockHashes n={self.n} block_bytes={self.block_bytes}>"


cdef class BlockDigests:
    """The digests of a prompt member's 64-byte blocks, made by the request scanner as it
    validated the body (csrc/reqscan.h): prefix_hash.h's per-block digest, which needs no
    seed, so the scanner makes them before it knows the model. Chained from a model's
    seed they are that member's block hashes, as hash_json makes them from its compact
    JSON text (less its last byte): hashes_for."""

    def __dealloc__(self):
        free(self.d)  # (s is its second half)

    def __len__(self):
        return self.n

    cdef BlockHashes hashes_for(self, object raw, bint prompt, uint64_t seed):
        """The block hashes of ``raw`` (the member's value, compact JSON text) from seed,
        thinned as BlockHashes.thin(THIN_AFTER, THIN_FACTOR) thins them, each hash
        avalanched only where it is kept; None when raw is not the member digested."""
        global _last_seed
        cdef BlockHashes out
        cdef Py_ssize_t i, j, n = self.n, rem
        cdef uint64_t s = seed
        cdef bint chained = seed == self.guess  # the scanner ran the chain from this seed
        if prompt != self.prompt or len(raw) != self.length:
            return None
        _last_seed = seed
        out = BlockHashes.__new__(BlockHashes)
        out.keys = <uint64_t *>malloc(max(n, 1) * sizeof(uint64_t))
        if out.keys == NULL:
            raise MemoryError()
        out.seed = seed
        out.block_bytes = 64
        out.fine = THIN_AFTER
        out.coarse = THIN_FACTOR
        j = 0
        if chained:  # the states are there: only the kept ones are read
            for i in range(min(n, <Py_ssize_t>THIN_AFTER)):
                out.keys[j] = vp_avalanche(self.s[i])
                j += 1
            i = THIN_AFTER + THIN_FACTOR - 1
            while i < n:
                out.keys[j] = vp_avalanche(self.s[i])
                j += 1
                i += THIN_FACTOR
            if n:
                s = self.s[n - 1]
        else:
            for i in range(n):
                s = vp_step(s, self.d[i])
                if i < THIN_AFTER or (i - THIN_AFTER) % THIN_FACTOR == THIN_FACTOR - 1:
                    out.keys[j] = vp_avalanche(s)
                    j += 1
        if n > THIN_AFTER:
            rem = (n - THIN_AFTER) % THIN_FACTOR
            if rem:
                out.keys[j] = vp_avalanche(s)
                j += 1
                out.tail = rem
        out.n = j
        return out


# The seed hashes_for last chained from: the scanner's guess for the next request's.
cdef uint64_t _last_seed = 0


cdef uint64_t digest_seed() noexcept:
    """The seed the request scanner runs the chain from (see BlockDigests): the one the
    router last used. A wrong guess costs only the chain's run again."""
    return _last_seed


cdef BlockDigests new_digests(Py_ssize_t cap):
    """Room for cap digests and their states, none made yet (the request scanner fills
    it, guess the seed it chains from)."""
    cdef BlockDigests out = BlockDigests.__new__(BlockDigests)
    out.d = <uint64_t *>malloc(max(cap, 1) * 2 * sizeof(uint64_t))
    if out.d == NULL:
        raise MemoryError()
    out.s = out.d + max(cap, 1)  # one allocation: s is d's second half
    out.cap = cap
    return out


cdef class PrefixHasher:
    """Cuts bytes into blocks and chains their hashes, seeded per model name."""

    def __init__(self, Py_ssize_t block_bytes=64):
        if block_bytes < <Py_ssize_t>VP_STRIPE or block_bytes % <Py_ssize_t>VP_STRIPE:
            raise ValueError(f"block_bytes must be a positive multiple of {VP_STRIPE}, got {block_bytes}")
        self.block_bytes = block_bytes
        self._seeds = {}

    cpdef uint64_t seed_for(self, str model) except? 0:
        """The chain seed of a model: its name hashed with the block size, so that chains of
        different models (or block sizes) never share a hash."""
        cached = self._seeds.get(model)
        if cached is not None:
            return <uint64_t>cached
        cdef uint64_t seed = _hash_obj(model, <uint64_t>self.block_bytes)
        if len(self._seeds) < 4096:  # model names come from config; the bound guards against junk
            self._seeds[model] = seed
        return seed

    cpdef BlockHashes hash(self, object data, str model):
        """Chained hashes of the full blocks of data (bytes-like) for this model."""
        cdef Py_buffer view
        cdef const unsigned char *p
        cdef size_t length, n
        cdef bint release = False
        cdef BlockHashes out = BlockHashes.__new__(BlockHashes)
        out.seed = self.seed_for(model)
        out.block_bytes = self.block_bytes
        if type(data) is bytes:
            p = <const unsigned char *>PyBytes_AS_STRING(data)
            length = <size_t>PyBytes_GET_SIZE(data)
        else:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            release = True
            p = <const unsigned char *>view.buf
            length = <size_t>view.len
        try:
            n = length // <size_t>self.block_bytes
            out.keys = <uint64_t *>malloc((n if n else 1) * sizeof(uint64_t))
            if out.keys == NULL:
                raise MemoryError()
            with nogil:
                out.n = <Py_ssize_t>vp_hash_blocks(p, length, <size_t>self.block_bytes, out.seed, out.keys)
        finally:
            if release:
                PyBuffer_Release(&view)
        return out


cdef class PrefixIndex:
    """Which endpoint was recently sent which block hashes: an LRU per endpoint.

    Endpoints are named by any hashable key and get one of 64 slots on first use;
    ``remove`` frees a slot. Capacity is in blocks, per endpoint.
    """

    def __cinit__(self):
        if vp_index_init(&self._ix) < 0:
            raise MemoryError()
        self._ready = True

    def __dealloc__(self):
        if self._ready:
            vp_index_free(&self._ix)

    def __init__(self, default_capacity=16384):
        if default_capacity < 0:
            raise ValueError("default_capacity must be >= 0")
        self.default_capacity = default_capacity
        self._slots = {}
        self._names = []
        self._active = 0

    cpdef int slot(self, object name) except -2:
        """The slot of name, taken on first use; -1 when all 64 are in use."""
        cdef object s = self._slots.get(name)
        cdef int i
        if s is not None:
            return <int>s
        for i in range(len(self._names)):
            if self._names[i] is None:
                break
        else:
            if len(self._names) >= VP_MAX_SLOTS:
                return -1
            self._names.append(None)
            i = len(self._names) - 1
        self._names[i] = name
        self._slots[name] = i
        self._active |= (<uint64_t>1) << i
        vp_set_capacity(&self._ix, <uint32_t>i, self.default_capacity)
        return i

    cpdef int slot_of(self, object name):
        """The slot of name, or -1 when it has none."""
        cdef object s = self._slots.get(name)
        return -1 if s is None else <int>s

    def remove(self, name):
        """Forget everything sent to name and free its slot."""
        cdef object s = self._slots.pop(name, None)
        if s is None:
            return
        cdef int i = <int>s
        vp_set_capacity(&self._ix, <uint32_t>i, 0)
        self._names[i] = None
        self._active &= ~((<uint64_t>1) << i)

    def set_capacity(self, name, capacity):
        """Bound name's LRU to capacity blocks, evicting the least recent beyond it."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        cdef int i = self.slot(name)
        if i >= 0:
            vp_set_capacity(&self._ix, <uint32_t>i, <uint64_t>capacity)

    def capacity(self, name):
        """name's capacity in blocks (the default if it has no slot yet)."""
        cdef int i = self.slot_of(name)
        return self.default_capacity if i < 0 else self._ix.lru[i].capacity

    def size(self, name):
        """Blocks currently held for name."""
        cdef int i = self.slot_of(name)
        return 0 if i < 0 else self._ix.lru[i].count

    def __len__(self):
        return self._ix.live

    def names(self):
        """The endpoints that hold a slot, in slot order."""
        return [n for n in self._names if n is not None]

    cpdef Py_ssize_t touch(self, object name, BlockHashes hashes) except -1:
        """Record that hashes were sent to name; return how many leading blocks it already
        held (0 when no slot is free for name)."""
        cdef int i = self.slot(name)
        cdef size_t held, run
        if i < 0:
            return 0
        # The leading keys that head the slot's list already are held, and stay put.
        run = vp_head_run(&self._ix, <uint32_t>i, hashes.keys, <size_t>hashes.n)
        held = run + vp_leading_held(&self._ix, <uint32_t>i, hashes.keys + run, <size_t>hashes.n - run)
        if vp_touch_chain(&self._ix, <uint32_t>i, hashes.keys, <size_t>hashes.n,
                          <size_t>(hashes.fine if hashes.coarse > 1 else hashes.n),
                          <uint32_t>(hashes.coarse if hashes.coarse > 1 else 1),
                          <uint32_t>hashes.tail, run) < 0:
            raise MemoryError()
        return hashes.blocks_of(<Py_ssize_t>held)

    cpdef list match(self, BlockHashes hashes):
        """Matched leading blocks of every slot, in one pass: a list indexed by slot (in
        blocks: a thinned chain's coarse hashes count as the blocks they stand for)."""
        cdef Py_ssize_t i, nslots = len(self._names)
        cdef list out
        if nslots == 0:
            return []
        for i in range(nslots):
            self._matched[i] = 0
        vp_match(&self._ix, hashes.keys, <size_t>hashes.n, self._active, self._matched)
        out = [0] * nslots
        for i in range(nslots):
            if self._matched[i]:
                out[i] = hashes.blocks_of(self._matched[i])
        return out

    def lru_keys(self, name):
        """name's block hashes from the most to the least recently used."""
        cdef int i = self.slot_of(name)
        cdef uint64_t *buf
        cdef size_t n
        if i < 0:
            return []
        n = <size_t>self._ix.lru[i].keys
        buf = <uint64_t *>malloc((n if n else 1) * sizeof(uint64_t))
        if buf == NULL:
            raise MemoryError()
        try:
            vp_lru_keys(&self._ix, <uint32_t>i, buf, n)
            return [buf[k] for k in range(n)]
        finally:
            free(buf)

    def stats(self):
        """Sizes: total blocks held, and per endpoint its blocks and capacity."""
        return {
            "blocks": self._ix.live,
            "distinct_blocks": self._ix.ents_used,
            "endpoints": {n: {"blocks": self._ix.lru[i].count, "capacity": self._ix.lru[i].capacity}
                          for i, n in enumerate(self._names) if n is not None},
        }


cdef str _BASIS_PREFIX = "prefix"
cdef str _BASIS_LOAD = "load"
cdef str _BASIS_HOTSPOT = "hotspot"


def choose_by_affinity(PrefixIndex index, BlockHashes hashes, list cands, list loads,
                       double hotspot_gap, double load_weight, uint64_t rand,
                       list waits=None, double hotspot_waiting=2.0):
    """The chat profile's scoring, in one compiled pass over the candidates.

    affinity(e) = matched leading blocks of e / blocks of the prompt;
    score(e) = affinity(e) - load_weight * (load(e) - least load) / hotspot_gap.
    The best score wins unless its engine is hot: then the best score among the
    endpoints that are not (basis "hotspot"), or, all being hot, the least loaded
    (the most affine among them). Without any affinity the least loaded wins.

    Hot is demand past what the engine serves at once: its own queue (``waits[i]``, the
    engine's waiting requests where its gauges are fresh) at ``hotspot_waiting`` or more;
    where ``waits`` is None or ``waits[i]`` negative (no fresh gauge), a load more than
    ``hotspot_gap`` above the least. An infinite ``hotspot_waiting`` turns the guard off.
    A spilled prefix is then held by the endpoint it spilled to too, so the best score
    among the cool ones is the next engine that already holds it: the prefix stays on the
    engines it was spread over, and does not scatter.
    Ties go to ``rand`` (one 64-bit draw). Candidates are objects with a ``name`` (the
    index key); loads are floats. Returns (position in cands, basis): "prefix", "load"
    or "hotspot".
    """
    cdef Py_ssize_t nc = len(cands), i, k
    cdef Py_ssize_t n = hashes.n
    cdef double total = <double>hashes.blocks_of(hashes.n)
    cdef double *aff
    cdef double small[SMALL_POOL]
    cdef object slot
    cdef bint any_affinity = False
    if nc == 0 or len(loads) != nc or (waits is not None and len(waits) != nc):
        raise ValueError("cands, loads and waits must be non-empty and of the same length")
    if nc <= SMALL_POOL:
        aff = &small[0]
    else:
        aff = <double *>malloc(nc * sizeof(double))
    if aff == NULL:
        raise MemoryError()
    try:
        for i in range(nc):
            aff[i] = 0.0
        if n and index._active:
            for k in range(len(index._names)):
                index._matched[k] = 0
            vp_match(&index._ix, hashes.keys, <size_t>n, index._active, index._matched)
            for i in range(nc):
                slot = index._slots.get(cands[i].name)
                if slot is not None and index._matched[<int>slot]:
                    aff[i] = hashes.blocks_of(index._matched[<int>slot]) / total
                    any_affinity = True
        return pick_by_affinity(aff, any_affinity, loads, waits, nc, hotspot_gap, load_weight,
                                hotspot_waiting, rand)
    finally:
        if aff != &small[0]:
            free(aff)


cdef tuple pick_by_affinity(double *aff, bint any_affinity, list loads, list waits, Py_ssize_t nc,
                            double hotspot_gap, double load_weight, double hotspot_waiting,
                            uint64_t rand):
    """choose_by_affinity's rule over affinities already known (also precise routing's:
    routing/precise/affinity.pyx). Lengths are checked by the callers."""
    cdef Py_ssize_t i, best
    cdef double *buf
    cdef double *load
    cdef double *score
    cdef bint *ok
    cdef bint *coolest
    cdef double min_load, cost, w
    cdef bint any_cool = False
    cdef double small[3 * SMALL_POOL]  # room for 2 * nc doubles and 2 * nc bints
    if nc <= SMALL_POOL:
        buf = &small[0]
    else:
        buf = <double *>malloc(2 * nc * sizeof(double) + 2 * nc * sizeof(bint))
    if buf == NULL:
        raise MemoryError()
    load = buf
    score = buf + nc
    ok = <bint *>(buf + 2 * nc)
    coolest = ok + nc
    try:
        min_load = INFINITY
        for i in range(nc):
            load[i] = <double>loads[i]
            if load[i] < min_load:
                min_load = load[i]
        for i in range(nc):
            coolest[i] = load[i] <= min_load + TIE_EPS
        if not any_affinity:
            return _nth_tie(aff, coolest, nc, rand), _BASIS_LOAD
        cost = load_weight / hotspot_gap if hotspot_gap > 0 else load_weight
        for i in range(nc):
            score[i] = aff[i] - cost * (load[i] - min_load)
            ok[i] = True
        best = _nth_tie(score, ok, nc, rand)
        if hotspot_waiting == INFINITY:  # the guard is off
            return best, _BASIS_PREFIX
        for i in range(nc):  # ok: not hot
            w = <double>waits[i] if waits is not None else -1.0
            ok[i] = w < hotspot_waiting if w >= 0.0 else load[i] - min_load <= hotspot_gap
            any_cool = any_cool or ok[i]
        if ok[best]:
            return best, _BASIS_PREFIX
        if any_cool:  # spill: the best score among the engines that are not hot
            return _nth_tie(score, ok, nc, rand), _BASIS_HOTSPOT
        return _nth_tie(aff, coolest, nc, rand), _BASIS_HOTSPOT
    finally:
        if buf != &small[0]:
            free(buf)


cdef Py_ssize_t _nth_tie(double *score, bint *eligible, Py_ssize_t nc, uint64_t rand) noexcept:
    """Position of the highest score among the eligible, ties (within TIE_EPS) at random."""
    cdef Py_ssize_t i, ties = 0
    cdef double top = -INFINITY
    for i in range(nc):
        if eligible[i] and score[i] > top:
            top = score[i]
    for i in range(nc):
        if eligible[i] and score[i] >= top - TIE_EPS:
            ties += 1
    ties = <Py_ssize_t>(rand % <uint64_t>ties)
    for i in range(nc):
        if eligible[i] and score[i] >= top - TIE_EPS:
            if ties == 0:
                return i
            ties -= 1
    return 0
