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
 * that stripes do not commute; lanes merged with distinct rotations. All four lanes at
 * once in AVX2 where the CPU has it (one multiply per 32 bytes), two at a time in SSE2
 * (every x86-64), the same arithmetic in plain C elsewhere. Words are little-endian on
 * every host, so the values are the same across runs, processes and machines. This is
 * not a cryptographic hash: a collision only costs a mis-routed request, never
 * correctness.
 */
#ifndef VELOCITY_PREFIX_HASH_H
#define VELOCITY_PREFIX_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(VP_NO_AVX2)
#define VP_HAVE_AVX2 1
#include <immintrin.h>
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

#if defined(VP_HAVE_AVX2)
/* The same digest, the four lanes in one AVX2 register: one multiply per 32 bytes, and
 * the lanes merged by variable shifts (a shift by 64 gives 0: the first lane's rotation
 * by 0). Inlined into the AVX2 loops below, never called from code built without it. */
__attribute__((target("avx2"))) static inline uint64_t vp_digest_block_avx2(const unsigned char *p, size_t n)
{
    const __m256i sl = _mm256_setr_epi64x(0, 19, 38, 57), sr = _mm256_setr_epi64x(64, 45, 26, 7);
    const __m256i step = _mm256_set1_epi64x((long long)VP_K4);
    __m256i acc = _mm256_setr_epi64x((long long)VP_K1, (long long)VP_K2, (long long)VP_K3, (long long)VP_K4);
    __m256i key = _mm256_setr_epi64x((long long)VP_KEY_A, (long long)VP_KEY_B, (long long)VP_KEY_C,
                                     (long long)VP_KEY_D);
    __m128i h;
    const unsigned char *end = p + n;
    for (; p < end; p += VP_STRIPE) {
        __m256i w = _mm256_loadu_si256((const __m256i *)p);
        __m256i k = _mm256_xor_si256(w, key);
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_mul_epu32(k, _mm256_srli_epi64(k, 32)), w));
        key = _mm256_add_epi64(key, step);
    }
    acc = _mm256_or_si256(_mm256_sllv_epi64(acc, sl), _mm256_srlv_epi64(acc, sr));
    h = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    return (uint64_t)_mm_cvtsi128_si64(h) + (uint64_t)_mm_extract_epi64(h, 1);
}

/* vp_hash_run's loop in AVX2 (the 64-byte block spelled out, so that its two stripes
 * unroll and their keys are constants). */
__attribute__((target("avx2"), noinline)) static uint64_t vp_hash_run_avx2(
    const unsigned char *p, size_t count, size_t block, uint64_t state, uint64_t *out)
{
    size_t i;
    if (block == 64) {
        for (i = 0; i < count; i++, p += 64) {
            state = vp_step(state, vp_digest_block_avx2(p, 64));
            out[i] = vp_avalanche(state);
        }
    } else {
        for (i = 0; i < count; i++, p += block) {
            state = vp_step(state, vp_digest_block_avx2(p, block));
            out[i] = vp_avalanche(state);
        }
    }
    return state;
}
#endif

/* Whether vp_hash_run takes AVX2: -1 not decided yet; then 1 or 0. The CPU decides,
 * unless VELOCITY_HASH_ISA=sse2 (or c) says otherwise: the values are the same either
 * way (the tests compare them), so this only ever changes the speed. */
static int vp_use_avx2 = -1;

static inline int vp_avx2(void)
{
    if (vp_use_avx2 < 0) {
#if defined(VP_HAVE_AVX2)
        const char *isa = getenv("VELOCITY_HASH_ISA");
        vp_use_avx2 = (isa == NULL || (strcmp(isa, "sse2") != 0 && strcmp(isa, "c") != 0))
                      && __builtin_cpu_supports("avx2");
#else
        vp_use_avx2 = 0;
#endif
    }
    return vp_use_avx2;
}

/* One block's digest by a named way (for tests: all must agree): 0 plain C, 1 SSE2 (plain
 * C where the host lacks it), 2 AVX2. -1 when this build or CPU cannot take AVX2. */
static inline int vp_digest_block_isa(const unsigned char *p, size_t n, int isa, uint64_t *out)
{
    if (isa == 0) {
        *out = vp_digest_block_c(p, n);
        return 0;
    }
    if (isa == 1) {
        *out = vp_digest_block(p, n);
        return 0;
    }
#if defined(VP_HAVE_AVX2)
    if (__builtin_cpu_supports("avx2")) {
        uint64_t key;
        *out = vp_hash_run_avx2(p, 1, n, 0, &key); /* one step from state 0 is the digest */
        return 0;
    }
#endif
    return -1;
}

/*
 * count consecutive blocks of `block` bytes from p, chained on from state: their hashes
 * into out[0..count), the new state returned. block must be a positive multiple of
 * VP_STRIPE.
 */
static inline uint64_t vp_hash_run(const unsigned char *p, size_t count, size_t block, uint64_t state,
                                   uint64_t *out)
{
    size_t i;
#if defined(VP_HAVE_AVX2)
    if (vp_avx2())
        return vp_hash_run_avx2(p, count, block, state, out);
#endif
    for (i = 0; i < count; i++, p += block) {
        state = vp_step(state, block == 64 ? vp_digest_block(p, 64) : vp_digest_block(p, block));
        out[i] = vp_avalanche(state);
    }
    return state;
}

/*
 * Hash the full blocks of data[0..len) into out[]; returns the number of blocks hashed
 * (len / block, the trailing partial block is left out). block must be a positive
 * multiple of VP_STRIPE; out must hold len / block values.
 */
static inline size_t vp_hash_blocks(const unsigned char *data, size_t len, size_t block,
                                    uint64_t seed, uint64_t *out)
{
    size_t n = len / block;
    vp_hash_run(data, n, block, seed, out);
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
