/*
 * Chained block hashing of prompt bytes for prefix-affinity routing.
 *
 * A prompt is cut into blocks of B bytes (B a multiple of 32). Each full block gets
 * a digest that depends on its bytes only, and the digests are chained:
 *     h_i = vp_chain(h_{i-1}, digest(block_i)),   h_{-1} = seed (from the model name)
 * so h_i names the whole prefix up to block i, as vLLM's own block hashes do.
 *
 * Why digest-then-chain rather than feeding the parent into the lanes: the digests of
 * consecutive blocks do not depend on each other, so the CPU overlaps them; only the
 * short chain step is serial. That keeps the hash at memory speed.
 *
 * The mixing is ours: four 64-bit lanes, each step folds one 8-byte word in, multiplies
 * by an odd constant (spreads low bits upwards) and rotates (brings the high bits back
 * down); lanes are merged with distinct rotations and finished with an xor-shift /
 * multiply avalanche. Words are read little-endian on every host, so the values are
 * the same across runs, processes and machines. This is not a cryptographic hash:
 * a collision only costs a mis-routed request, never correctness.
 */
#ifndef VELOCITY_PREFIX_HASH_H
#define VELOCITY_PREFIX_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Odd multipliers: 2^64 / golden ratio, then the fractional parts of the square roots
 * of 3, 5, 7, 11 and 13 (forced odd) -- constants with nothing up the sleeve. */
#define VP_K0 0x9E3779B97F4A7C15ULL
#define VP_K1 0xBB67AE8584CAA73BULL
#define VP_K2 0x3C6EF372FE94F82BULL
#define VP_K3 0xA54FF53A5F1D36F1ULL
#define VP_K4 0x510E527FADE682D1ULL
#define VP_K5 0x9B05688C2B3E6C1FULL

/* Bytes one step of the four lanes consumes. */
#define VP_STRIPE 32

static inline uint64_t vp_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t vp_read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* unaligned-safe; compiles to one load */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* One lane step: fold a word in, multiply, rotate. Bijective in the word, so two
 * blocks that differ in a single word always differ in that lane. */
static inline uint64_t vp_lane(uint64_t v, uint64_t w, uint64_t k)
{
    return vp_rotl((v ^ w) * k, 29);
}

/* Final avalanche: every input bit reaches every output bit. Bijective. */
static inline uint64_t vp_avalanche(uint64_t h)
{
    h ^= h >> 31;
    h *= VP_K5;
    h ^= h >> 29;
    h *= VP_K0;
    h ^= h >> 32;
    return h;
}

/* Digest of n bytes, n a multiple of VP_STRIPE (the caller guarantees it). */
static inline uint64_t vp_digest_stripes(const unsigned char *p, size_t n)
{
    uint64_t a = VP_K1, b = VP_K2, c = VP_K3, d = VP_K4;
    const unsigned char *end = p + n;
    for (; p < end; p += VP_STRIPE) {
        a = vp_lane(a, vp_read64(p), VP_K0);
        b = vp_lane(b, vp_read64(p + 8), VP_K1);
        c = vp_lane(c, vp_read64(p + 16), VP_K2);
        d = vp_lane(d, vp_read64(p + 24), VP_K3);
    }
    /* Distinct rotations so that equal lane values do not cancel. */
    return a + vp_rotl(b, 19) + vp_rotl(c, 38) + vp_rotl(d, 57);
}

/* The chain step: bijective in the parent for a fixed digest and in the digest for a
 * fixed parent, so changing block i changes h_i and, through it, every later hash. */
static inline uint64_t vp_chain(uint64_t parent, uint64_t digest)
{
    return vp_avalanche(vp_rotl(parent * VP_K4, 23) ^ digest);
}

/*
 * Hash the full blocks of data[0..len) into out[]; returns the number of blocks hashed
 * (len / block, the trailing partial block is left out). block must be a positive
 * multiple of VP_STRIPE; out must hold len / block values.
 */
static inline size_t vp_hash_blocks(const unsigned char *data, size_t len, size_t block,
                                    uint64_t seed, uint64_t *out)
{
    size_t n = len / block, i;
    uint64_t h = seed;
    for (i = 0; i < n; i++) {
        h = vp_chain(h, vp_digest_stripes(data + i * block, block));
        out[i] = h;
    }
    return n;
}

/* Hash of arbitrary bytes (model names, session ids, endpoint names): whole stripes,
 * then the tail zero-padded, with the length mixed in so that padding cannot collide. */
static inline uint64_t vp_hash_bytes(const unsigned char *data, size_t len, uint64_t seed)
{
    unsigned char tail[VP_STRIPE];
    size_t whole = len - len % VP_STRIPE;
    uint64_t h = vp_chain(seed, (uint64_t)len * VP_K2);
    if (whole)
        h = vp_chain(h, vp_digest_stripes(data, whole));
    memset(tail, 0, sizeof tail);
    if (len > whole)
        memcpy(tail, data + whole, len - whole);
    return vp_chain(h, vp_digest_stripes(tail, VP_STRIPE));
}

/* Rendezvous weight of (key, node): a full avalanche of both, so that the ranking of
 * nodes for one key is independent of the ranking for any other key. */
static inline uint64_t vp_rendezvous(uint64_t key, uint64_t node)
{
    return vp_chain(key, node ^ VP_K3);
}

#endif /* VELOCITY_PREFIX_HASH_H */
