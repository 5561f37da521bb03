/*
 * Chained block hashing of prompt bytes for prefix-affinity routing.
 *
 * A prompt is cut into blocks of B bytes (B a multiple of 32). Each full block gets
 * a digest that depends on its bytes only, and the digests are chained through a state:
 *     s_i = vp_step(s_{i-1}, vp_digest_block(block_i)),   s_{-1} = seed (from the model name)
 *     h_i = vp_avalanche(s_i)
 * so h_i names the whole prefix up to block i, as vLLM's own block hashes do (the step
 * is a bijection in the state for a fixed digest and in the digest for a fixed state,
 * and the avalanche a bijection: two prefixes that differ anywhere differ from there on).
 *
 * Why digest-then-chain rather than feeding the parent into the lanes: the digests of
 * consecutive blocks do not depend on each other, so the CPU overlaps them; only the
 * step is serial, a multiply, a rotation and an xor (the avalanche of each h_i is off
 * that path). With the avalanche inside the step, its ~17 cycles a block were the
 * bound, not the bytes.
 *
 * The block digest: four 64-bit lanes, each taking one 8-byte word w of every 32-byte
 * stripe: k = w ^ key, lane += lo32(k) * hi32(k) + w, the keys moving on each stripe so
 * that stripes do not commute; lanes merged with distinct rotations. Two lanes at a time
 * in SSE2 (every x86-64: one multiply per 16 bytes), the same arithmetic in plain C
 * elsewhere. Words are little-endian on every host, so the values are the same across
 * runs, processes and machines. This is not a cryptographic hash: a collision only
 * costs a mis-routed request, never correctness.
 */
#ifndef VELOCITY_PREFIX_HASH_H
#define VELOCITY_PREFIX_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* The block chain's step (see the top): serial, so short. */
static inline uint64_t vp_step(uint64_t state, uint64_t digest)
{
    return vp_rotl(state * VP_K4, 23) ^ digest;
}

/* The block digest's lane keys, and how they move from one stripe to the next. */
#define VP_KEY_A VP_K0
#define VP_KEY_B VP_K5
#define VP_KEY_C (VP_K2 ^ VP_K5)
#define VP_KEY_D (VP_K3 ^ VP_K0)

static inline uint64_t vp_lane_word(uint64_t w, uint64_t key)
{
    uint64_t k = w ^ key;
    return (uint64_t)(uint32_t)k * (k >> 32) + w;
}

/* Digest of one block of n bytes, n a multiple of VP_STRIPE, in plain C on every host
 * (vp_digest_block's values; the tests compare the two). */
static inline uint64_t vp_digest_block_c(const unsigned char *p, size_t n)
{
    uint64_t ka = VP_KEY_A, kb = VP_KEY_B, kc = VP_KEY_C, kd = VP_KEY_D;
    uint64_t a = VP_K1, b = VP_K2, c = VP_K3, d = VP_K4;
    const unsigned char *end = p + n;
    for (; p < end; p += VP_STRIPE) {
        a += vp_lane_word(vp_read64(p), ka);
        b += vp_lane_word(vp_read64(p + 8), kb);
        c += vp_lane_word(vp_read64(p + 16), kc);
        d += vp_lane_word(vp_read64(p + 24), kd);
        ka += VP_K4; kb += VP_K4; kc += VP_K4; kd += VP_K4;
    }
    return a + vp_rotl(b, 19) + vp_rotl(c, 38) + vp_rotl(d, 57);
}

/* The same digest, two lanes a multiply in SSE2 where the host has it. */
static inline uint64_t vp_digest_block(const unsigned char *p, size_t n)
{
#if defined(__SSE2__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v[4];
    const unsigned char *end = p + n;
    __m128i ab = _mm_set_epi64x((long long)VP_K2, (long long)VP_K1);
    __m128i cd = _mm_set_epi64x((long long)VP_K4, (long long)VP_K3);
    __m128i kab = _mm_set_epi64x((long long)VP_KEY_B, (long long)VP_KEY_A);
    __m128i kcd = _mm_set_epi64x((long long)VP_KEY_D, (long long)VP_KEY_C);
    const __m128i step = _mm_set1_epi64x((long long)VP_K4);
    for (; p < end; p += VP_STRIPE) {
        __m128i w0 = _mm_loadu_si128((const __m128i *)p);
        __m128i w1 = _mm_loadu_si128((const __m128i *)(p + 16));
        __m128i k0 = _mm_xor_si128(w0, kab), k1 = _mm_xor_si128(w1, kcd);
        ab = _mm_add_epi64(ab, _mm_add_epi64(_mm_mul_epu32(k0, _mm_srli_epi64(k0, 32)), w0));
        cd = _mm_add_epi64(cd, _mm_add_epi64(_mm_mul_epu32(k1, _mm_srli_epi64(k1, 32)), w1));
        kab = _mm_add_epi64(kab, step);
        kcd = _mm_add_epi64(kcd, step);
    }
    _mm_storeu_si128((__m128i *)v, ab);
    _mm_storeu_si128((__m128i *)(v + 2), cd);
    return v[0] + vp_rotl(v[1], 19) + vp_rotl(v[2], 38) + vp_rotl(v[3], 57);
#else
    return vp_digest_block_c(p, n);
#endif
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
    uint64_t s = seed;
    for (i = 0; i < n; i++) {
        s = vp_step(s, vp_digest_block(data + i * block, block));
        out[i] = vp_avalanche(s);
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
