/*
 * The top level of a request body, found in one strict pass over its bytes.
 *
 * The gateway reads a handful of a request's fields (model, stream, max_tokens, ...);
 * the prompt (`messages`, `prompt`) and whatever else the client sent (`tools`,
 * sampling options) only pass through. A JSON decoder still walks every byte of those,
 * at several instructions a byte. This scanner walks them once at SIMD speed inside
 * strings, validates the whole body as msgspec does (RFC 8259: no trailing commas, no
 * control bytes in strings, escapes as the grammar says, no lone surrogates; like
 * msgspec it leaves the UTF-8 of strings to the engine), and names where each
 * top-level member lies. The caller then decodes only the members it reads, and
 * leaves the prompt as a span of the original body.
 *
 * It takes no body it is not sure of: anything else (not an object, malformed JSON,
 * nesting past VR_MAX_DEPTH, more than VR_MAX_MEMBERS members, a key with escapes,
 * a prompt field named twice) returns -1 and the caller decodes the whole body as
 * before, which gives the exact error or the same result.
 *
 * Included by gateway/requests.pyx. Its leaves and its value walk are shared with the
 * renderer's scanner (json_lex.h, json_skip.h); its string walk is its own
 * (reqscan_string.h), as msgspec leaves the UTF-8 of the strings it skips unchecked.
 */
#ifndef VELOCITY_REQSCAN_H
#define VELOCITY_REQSCAN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "json_lex.h"
#include "prefix_hash.h"

/* Depth past which the caller's decoder decides (it refuses bodies nested about 1,000
 * levels; real requests nest fewer than ten). */
#define VR_MAX_DEPTH 256
#define VR_MAX_MEMBERS 64

/* The members the gateway's decoder reads, by id (vr_member.field). */
#define VR_OTHER (-1)
#define VR_MESSAGES 0
#define VR_PROMPT 1
#define VR_PRIORITY 2
#define VR_SLA_MS 3
#define VR_READ 4 /* any other field the decoder declares (model, stream, ...) */

typedef struct {
    size_t ks;  /* the key's opening quote */
    size_t vs;  /* the value's first byte */
    size_t ve;  /* one past the value's last byte */
    int field;  /* VR_* */
    int spaced; /* whitespace between the value's tokens */
} vr_member;

typedef struct {
    int n;
    int messages, prompt; /* member index, -1 when absent */
    int own;              /* members that are the gateway's own (priority, sla_ms) */
    size_t read_bytes;    /* bytes of the members the decoder reads, prompts left out */
    vr_member m[VR_MAX_MEMBERS];
} vr_object;

/* The prompt member's 64-byte blocks digested as the walk passes them (prefix_hash.h's
 * vp_digest_block: the part of a block's hash that needs no seed, so the model's name,
 * which may come after the prompt, is not needed yet). vr_scan digests the first
 * messages or prompt member it meets, from the value's first byte, block by block up to
 * its last byte (left out, as routing/blockscan.pyx's hash_json leaves it out); the
 * router chains them from the model's seed into that member's block hashes
 * (routing/prefix.pyx, BlockDigests). The chain is serial, a multiply deep a block, so
 * it is run here too, beside the walk, from the seed of the model the router last
 * hashed for (the usual case: one model); the router takes those states when its seed
 * is that one, and chains the digests itself when not. */
typedef struct {
    uint64_t *d;               /* room for (body length / 64) + 1 digests */
    uint64_t *s;               /* as many: the chain's state after each, from the seed guessed */
    uint64_t state;            /* the chain's state now (the seed guessed before the first) */
    size_t n;                  /* digests made */
    const unsigned char *next; /* the next block to digest */
    int field;                 /* the member digested (VR_MESSAGES, VR_PROMPT), -1 none */
    size_t vs, ve;             /* its value's span in the body */
} vr_digests;

/* The bytes that may follow a backslash as a one-letter escape. */
static const unsigned char vr_escape1[256] = {
    ['"'] = 1, ['\\'] = 1, ['/'] = 1, ['b'] = 1, ['f'] = 1, ['n'] = 1, ['r'] = 1, ['t'] = 1,
};

/* The rest of a string from p (inside it) byte run by byte run: one past its closing
 * quote, NULL when invalid. The plain runs go at SIMD speed; each quote, escape or
 * control byte is a branch. */
static const unsigned char *vr_string_tail(const unsigned char *p, const unsigned char *e)
{
    uint32_t cp;
    for (;;) {
        p = vb_find_special(p, e, 0);
        if (p >= e)
            return NULL;
        if (*p == '"')
            return p + 1;
        if (*p != '\\')
            return NULL; /* a control byte */
        /* \n, \", \\ and the other one-letter escapes in place; \u checked whole */
        if (e - p >= 2 && p[1] != 'u' && vr_escape1[p[1]]) {
            p += 2;
            continue;
        }
        if (vb_escape(&p, e, &cp) < 0)
            return NULL;
    }
}

#if defined(__SSE2__)
/* Bit i of each mask: byte p[i] is a quote, a backslash, a control byte (< 0x20). */
static inline void vr_masks64_sse2(const unsigned char *p, uint64_t *quote, uint64_t *bslash, uint64_t *ctl)
{
    const __m128i q = _mm_set1_epi8('"'), b = _mm_set1_epi8('\\'), c1f = _mm_set1_epi8(0x1F);
    uint64_t mq = 0, mb = 0, mc = 0;
    int k;
    for (k = 0; k < 4; k++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(p + 16 * k));
        mq |= (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, q)) << (16 * k);
        mb |= (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v, b)) << (16 * k);
        mc |= (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(v, c1f), c1f)) << (16 * k);
    }
    *quote = mq;
    *bslash = mb;
    *ctl = mc;
}

/*
 * The string at p (its opening quote): one past its closing quote, NULL when invalid
 * (a control byte, an escape the grammar does not have, a lone surrogate).
 * csrc/reqscan_string.h, made once per instruction set: SSE2 (every x86-64), and AVX2
 * where the compiler can target it (GCC: clang builds keep SSE2), chosen at run time
 * (vr_use_avx2).
 */
#define VR_STRING vr_string_sse2
#define VR_MASKS64 vr_masks64_sse2
#define VR_DIGEST64(b) vp_digest_block((b), 64)
#include "reqscan_string.h"
#undef VR_STRING
#undef VR_MASKS64
#undef VR_DIGEST64

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(VR_NO_AVX2)
#define VR_HAVE_AVX2 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2")
/* vr_masks64_sse2's masks, 32 bytes a compare. */
static inline void vr_masks64_avx2(const unsigned char *p, uint64_t *quote, uint64_t *bslash, uint64_t *ctl)
{
    const __m256i q = _mm256_set1_epi8('"'), b = _mm256_set1_epi8('\\'), c1f = _mm256_set1_epi8(0x1F);
    __m256i v0 = _mm256_loadu_si256((const __m256i *)p);
    __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    *quote = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v0, q))
             | (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v1, q)) << 32;
    *bslash = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v0, b))
              | (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v1, b)) << 32;
    *ctl = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(v0, c1f), c1f))
           | (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(v1, c1f), c1f)) << 32;
}
/* Bit i: p[i] is a byte an escape may name (" \\ / b f n r t u), and p[i] is 'u'. Two
 * nibble look-ups: the low nibble's entry names the high nibbles it pairs with. */
static inline void vr_escmasks64_avx2(const unsigned char *p, uint64_t *named, uint64_t *u)
{
    const __m256i lo_tab = _mm256_setr_epi8(0, 0, 0x0D, 0, 0x08, 0x08, 0x04, 0, 0, 0, 0, 0, 0x02, 0, 0x04, 0x01,
                                            0, 0, 0x0D, 0, 0x08, 0x08, 0x04, 0, 0, 0, 0, 0, 0x02, 0, 0x04, 0x01);
    const __m256i hi_tab = _mm256_setr_epi8(0, 0, 0x01, 0, 0, 0x02, 0x04, 0x08, 0, 0, 0, 0, 0, 0, 0, 0,
                                            0, 0, 0x01, 0, 0, 0x02, 0x04, 0x08, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i nib = _mm256_set1_epi8(0x0F), uu = _mm256_set1_epi8('u'), zero = _mm256_setzero_si256();
    __m256i v0 = _mm256_loadu_si256((const __m256i *)p);
    __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    __m256i c0 = _mm256_and_si256(_mm256_shuffle_epi8(lo_tab, _mm256_and_si256(v0, nib)),
                                  _mm256_shuffle_epi8(hi_tab, _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib)));
    __m256i c1 = _mm256_and_si256(_mm256_shuffle_epi8(lo_tab, _mm256_and_si256(v1, nib)),
                                  _mm256_shuffle_epi8(hi_tab, _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib)));
    *named = ~((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c0, zero))
               | (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(c1, zero)) << 32);
    *u = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v0, uu))
         | (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v1, uu)) << 32;
}
#define VR_STRING vr_string_avx2
#define VR_MASKS64 vr_masks64_avx2
#define VR_ESCMASKS64 vr_escmasks64_avx2
#define VR_DIGEST64(b) vp_digest_block_avx2((b), 64)
#define VR_STRING_NOINLINE 1
#include "reqscan_string.h"
#undef VR_STRING
#undef VR_MASKS64
#undef VR_ESCMASKS64
#undef VR_DIGEST64
#undef VR_STRING_NOINLINE
#pragma GCC pop_options

#if !defined(VR_NO_AVX512)
#define VR_HAVE_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,bmi,bmi2")
/* vr_masks64_avx2's masks from one 64-byte register, each compare straight into a mask
 * (no movemask, no shifts to join two halves). */
static inline void vr_masks64_avx512(const unsigned char *p, uint64_t *quote, uint64_t *bslash, uint64_t *ctl)
{
    __m512i v = _mm512_loadu_si512((const void *)p);
    uint64_t q = (uint64_t)_mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8('"'));
    uint64_t b = (uint64_t)_mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8('\\'));
    uint64_t c = (uint64_t)_mm512_cmplt_epu8_mask(v, _mm512_set1_epi8(0x20));
    /* Into general registers here: left as masks, the compiler folds the walk's
     * `quote & ~escaped` into a masked compare, which puts the compare (and two moves
     * between register files) on the chain that waits for the escapes. */
    __asm__("" : "+r"(q), "+r"(b), "+r"(c));
    *quote = q;
    *bslash = b;
    *ctl = c;
}
/* vr_escmasks64_avx2's two nibble look-ups over the 64 bytes at once. */
static inline void vr_escmasks64_avx512(const unsigned char *p, uint64_t *named, uint64_t *u)
{
    const __m512i lo_tab = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 0, 0x0D, 0, 0x08, 0x08, 0x04, 0, 0, 0, 0, 0, 0x02, 0, 0x04, 0x01));
    const __m512i hi_tab = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 0, 0x01, 0, 0, 0x02, 0x04, 0x08, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512i v = _mm512_loadu_si512((const void *)p);
    __m512i c = _mm512_and_si512(_mm512_shuffle_epi8(lo_tab, _mm512_and_si512(v, nib)),
                                 _mm512_shuffle_epi8(hi_tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)));
    *named = (uint64_t)_mm512_test_epi8_mask(c, c);
    *u = (uint64_t)_mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8('u'));
}
#define VR_STRING vr_string_avx512
#define VR_MASKS64 vr_masks64_avx512
#define VR_ESCMASKS64 vr_escmasks64_avx512
#define VR_DIGEST64(b) vp_digest_block_avx2((b), 64)
#define VR_STRING_NOINLINE 1
#include "reqscan_string.h"
#undef VR_STRING
#undef VR_MASKS64
#undef VR_ESCMASKS64
#undef VR_DIGEST64
#undef VR_STRING_NOINLINE
#pragma GCC pop_options
#endif
#endif
#endif

/* Which string walk vr_scan uses: -1 not yet decided, 0 SSE2 (or bytes), 1 AVX2, 2
 * AVX-512 (BW). The CPU decides at the first scan; vr_set_isa overrides it (tests walk
 * each). */
static int vr_isa = -1;

/* The best walk this build and CPU have (0, 1 or 2, as vr_isa). AVX-512 only from Ice
 * Lake and Zen 4 on (VBMI2 marks them, as simdjson's choice of its AVX-512 kernel does):
 * on the first AVX-512 cores a burst of 512-bit work lowers the whole core's clock for a
 * while, which every other request on it would pay. */
static int vr_best_isa(void)
{
#if defined(VR_HAVE_AVX512)
    if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f")
        && __builtin_cpu_supports("avx512vbmi2"))
        return 2;
#endif
#if defined(VR_HAVE_AVX2)
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* The walk to use: 2 AVX-512, 1 AVX2, 0 SSE2, -1 the CPU's best; one the CPU lacks
 * falls to the best below it. Returns the walk in use now (as vr_isa). */
static int vr_set_isa(int isa)
{
    int best = vr_best_isa();
    vr_isa = (isa < 0 || isa > best) ? best : isa;
    return vr_isa;
}

static inline const unsigned char *vr_string(const unsigned char *p, const unsigned char *e, vr_digests *dg)
{
#if defined(VR_HAVE_AVX512)
    if (vr_isa == 2)
        return vr_string_avx512(p, e, dg);
#endif
#if defined(VR_HAVE_AVX2)
    if (vr_isa == 1)
        return vr_string_avx2(p, e, dg);
#endif
#if defined(__SSE2__)
    return vr_string_sse2(p, e, dg);
#else
    (void)dg;
    return vr_string_tail(p + 1, e);
#endif
}

/* The value at p (no whitespace before it): one past it, NULL when invalid or nested
 * past depth levels; *spaced set when there is whitespace between its tokens. The walk
 * is json_skip.h's, with this scanner's string walk. */
#define JSON_SKIP vr_value
#define JSON_SKIP_STRING vr_string
#define JSON_SKIP_STACK VR_MAX_DEPTH
#define JSON_SKIP_CTX vr_digests *
#include "json_skip.h"
#undef JSON_SKIP
#undef JSON_SKIP_STRING
#undef JSON_SKIP_STACK
#undef JSON_SKIP_CTX

#define VR_IS(k, n, lit) ((n) == sizeof(lit) - 1 && memcmp((k), (lit), (n)) == 0)

/* The field id of key k[0..n) (its bytes without the quotes), among the decoder's. */
static int vr_field(const unsigned char *k, size_t n)
{
    if (VR_IS(k, n, "messages"))
        return VR_MESSAGES;
    if (VR_IS(k, n, "prompt"))
        return VR_PROMPT;
    if (VR_IS(k, n, "priority"))
        return VR_PRIORITY;
    if (VR_IS(k, n, "sla_ms"))
        return VR_SLA_MS;
    if (VR_IS(k, n, "model") || VR_IS(k, n, "stream") || VR_IS(k, n, "stream_options") || VR_IS(k, n, "max_tokens")
        || VR_IS(k, n, "max_completion_tokens") || VR_IS(k, n, "user"))
        return VR_READ;
    return VR_OTHER;
}

/* The blocks of [dg->next, end) not digested yet. */
static void vr_digest_to(vr_digests *dg, const unsigned char *end)
{
    while (dg->next + 64 <= end) {
        uint64_t d = vp_digest_block(dg->next, 64);
        dg->d[dg->n] = d;
        dg->s[dg->n++] = dg->state = vp_step(dg->state, d);
        dg->next += 64;
    }
}

/* Scan data[0..len), a request body: 0 and out filled, or -1 (not taken, see above).
 * dg, when not NULL (room for len / 64 + 1 digests): the first messages or prompt
 * member's blocks digested too (vr_digests); dg->field -1 when there is none or its
 * value has whitespace between its tokens (then it is hashed compacted, not here). */
static int vr_scan(const unsigned char *data, size_t len, vr_object *out, vr_digests *dg)
{
    const unsigned char *p = data, *e = data + len, *q;
    vr_digests *walk;
    vr_member *m;
    if (vr_isa < 0)
        vr_set_isa(-1);
    out->n = 0;
    out->messages = out->prompt = -1;
    out->own = 0;
    out->read_bytes = 0;
    if (dg != NULL) {
        dg->n = 0;
        dg->field = -1;
        dg->next = NULL; /* no member taken yet */
    }
    p = vb_skip_space(p, e);
    if (p >= e || *p != '{')
        return -1;
    p = vb_skip_space(p + 1, e);
    if (p < e && *p == '}') {
        p++;
        goto end;
    }
    for (;;) {
        if (p >= e || *p != '"' || out->n == VR_MAX_MEMBERS)
            return -1;
        m = &out->m[out->n];
        m->ks = (size_t)(p - data);
        q = vr_string(p, e, NULL);
        if (q == NULL || memchr(p + 1, '\\', (size_t)(q - p - 2)) != NULL)
            return -1;
        m->field = vr_field(p + 1, (size_t)(q - p - 2));
        p = vb_skip_space(q, e);
        if (p >= e || *p != ':')
            return -1;
        p = vb_skip_space(p + 1, e);
        m->vs = (size_t)(p - data);
        walk = NULL;
        if (dg != NULL && dg->next == NULL && (m->field == VR_MESSAGES || m->field == VR_PROMPT)) {
            walk = dg;
            dg->next = p;
        }
        q = vr_value(p, e, VR_MAX_DEPTH - 1, &m->spaced, walk);
        if (q == NULL)
            return -1;
        m->ve = (size_t)(q - data);
        if (walk != NULL) {
            /* the rest of its blocks, up to its last byte (left out) */
            vr_digest_to(dg, q - 1);
            if (m->spaced) {
                dg->n = 0; /* hashed compacted instead; no later member is digested */
            } else {
                dg->field = m->field;
                dg->vs = m->vs;
                dg->ve = m->ve;
            }
        }
        switch (m->field) {
        case VR_MESSAGES:
            if (out->messages >= 0)
                return -1;
            out->messages = out->n;
            out->read_bytes += m->vs - m->ks + 2;
            break;
        case VR_PROMPT:
            if (out->prompt >= 0)
                return -1;
            out->prompt = out->n;
            out->read_bytes += m->vs - m->ks + 2;
            break;
        case VR_PRIORITY:
        case VR_SLA_MS:
            out->own++;
            /* fall through */
        case VR_READ:
            out->read_bytes += m->ve - m->ks + 1;
            break;
        }
        out->n++;
        p = vb_skip_space(q, e);
        if (p < e && *p == ',') {
            p = vb_skip_space(p + 1, e);
            continue;
        }
        if (p < e && *p == '}') {
            p++;
            break;
        }
        return -1;
    }
end:
    return vb_skip_space(p, e) == e ? 0 : -1;
}

/* The object of the members the decoder reads, into dst (room for read_bytes + 2):
 * `{` those members, each as it came, with `messages` and `prompt` (present) given the
 * value 0, joined by commas `}`. Its length. */
static size_t vr_reduce(const unsigned char *data, const vr_object *o, unsigned char *dst)
{
    unsigned char *w = dst;
    const vr_member *m;
    int i, first = 1;
    *w++ = '{';
    for (i = 0; i < o->n; i++) {
        m = &o->m[i];
        if (m->field == VR_OTHER)
            continue;
        if (!first)
            *w++ = ',';
        first = 0;
        if (m->field == VR_MESSAGES || m->field == VR_PROMPT) {
            memcpy(w, data + m->ks, m->vs - m->ks);
            w += m->vs - m->ks;
            *w++ = '0';
        } else {
            memcpy(w, data + m->ks, m->ve - m->ks);
            w += m->ve - m->ks;
        }
    }
    *w++ = '}';
    return (size_t)(w - dst);
}

/* Bytes of the body without the gateway's own members (priority, sla_ms), as
 * vr_strip writes it. */
static size_t vr_strip_len(const vr_object *o)
{
    size_t n = 2;
    int i, kept = 0;
    for (i = 0; i < o->n; i++) {
        if (o->m[i].field == VR_PRIORITY || o->m[i].field == VR_SLA_MS)
            continue;
        n += o->m[i].ve - o->m[i].ks;
        kept++;
    }
    return n + (kept ? (size_t)(kept - 1) : 0);
}

/* The body without the gateway's own members into dst (vr_strip_len bytes): `{` the
 * others, each byte for byte as it came, joined by commas `}`. */
static void vr_strip(const unsigned char *data, const vr_object *o, unsigned char *dst)
{
    unsigned char *w = dst;
    int i, first = 1;
    *w++ = '{';
    for (i = 0; i < o->n; i++) {
        const vr_member *m = &o->m[i];
        if (m->field == VR_PRIORITY || m->field == VR_SLA_MS)
            continue;
        if (!first)
            *w++ = ',';
        first = 0;
        memcpy(w, data + m->ks, m->ve - m->ks);
        w += m->ve - m->ks;
    }
    *w = '}';
}

/* The JSON value data[0..len) without the whitespace between its tokens, into dst
 * (room for len bytes): its length. data must be valid JSON (vr_scan took it). */
static size_t vr_compact(const unsigned char *data, size_t len, unsigned char *dst)
{
    const unsigned char *p = data, *e = data + len, *run = data;
    unsigned char *w = dst;
    while ((p = vb_next_space(p, e)) < e) {
        memcpy(w, run, (size_t)(p - run));
        w += p - run;
        run = p = vb_skip_space(p, e);
    }
    memcpy(w, run, (size_t)(e - run));
    w += e - run;
    return (size_t)(w - dst);
}

#endif
