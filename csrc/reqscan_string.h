/*
 * A template, included by reqscan.h once per instruction set, with VR_STRING (the
 * function's name), VR_MASKS64 (its 64-byte mask reader) and VR_DIGEST64 (prefix_hash.h's
 * digest of a 64-byte block in the same set) defined, and VR_ESCMASKS64 where the set
 * can classify 64 bytes at once (AVX2: two nibble look-ups). No include guard.
 *
 * dg, when not NULL: the prompt member's blocks are digested as the walk goes, each
 * once the walk is past it (vr_digests), so that the digest's multiplies run beside the
 * walk's chain of bit operations instead of in a second pass.
 *
 * The string at p (its opening quote): one past its closing quote, NULL when invalid
 * (a control byte, an escape the grammar does not have, a lone surrogate).
 *
 * Prompts escape often (a newline, a quote every few dozen bytes), and a branch per
 * escape costs a misprediction each. So the string is read 64 bytes at a time as bit
 * masks: the escaped bytes are found by walking the backslashes (one step per escape,
 * no branch on the bytes between), the string's end is the first quote not escaped, and
 * the chunk is refused at once if a control byte lies before it. The escaped bytes are
 * checked against the grammar one by one, or, with VR_ESCMASKS64, all of a chunk's at
 * once, leaving only the \u escapes to be read one by one.
 */
#ifndef VR_EVEN_BITS
#define VR_EVEN_BITS 0x5555555555555555ULL
#endif
#if defined(VR_STRING_NOINLINE)
static const unsigned char *VR_STRING(const unsigned char *p, const unsigned char *e, vr_digests *dg)
#else
static inline const unsigned char *VR_STRING(const unsigned char *p, const unsigned char *e, vr_digests *dg)
#endif
{
    p++;
#if defined(__SSE2__)
    /* A key or a short value ("role", "user", "content") ends within 16 bytes with
     * nothing to check on the way: one compare, and no 64-byte chunk set up for it. */
    if (e - p >= 16) {
        const __m128i v = _mm_loadu_si128((const __m128i *)p);
        const __m128i c1f = _mm_set1_epi8(0x1F);
        unsigned m = (unsigned)_mm_movemask_epi8(
            _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')), _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                         _mm_cmpeq_epi8(_mm_max_epu8(v, c1f), c1f)));
        if (m && p[__builtin_ctz(m)] == '"')
            return p + __builtin_ctz(m) + 1;
    }
#endif
    {
        const unsigned char *skip = p; /* bytes before it were read by a \u escape */
        uint64_t carry = 0;            /* the chunk's first byte is escaped */
        uint32_t cp;
        while (e - p >= 64) {
            uint64_t quote, bslash, ctl, esc, bs, starts, even_ends, odd_ends, quotes, before, ev;
            unsigned long long odd_sum;
            if (dg != NULL) {
                /* the blocks wholly before this chunk: walked, and inside the member */
                while (dg->next + 64 <= p) {
                    uint64_t d = VR_DIGEST64(dg->next);
                    dg->d[dg->n] = d;
                    dg->s[dg->n++] = dg->state = vp_step(dg->state, d);
                    dg->next += 64;
                }
            }
            VR_MASKS64(p, &quote, &bslash, &ctl);
            /* The escaped bytes, without a branch: a byte is escaped when the run of
             * backslashes before it is odd. Adding each run's first bit to the run ripples
             * a carry to the byte past its end; the run is odd when its start and that
             * end differ in parity. A run that began at an odd bit and reaches bit 63
             * overflows: the next chunk's first byte is escaped. */
            bs = bslash & ~carry; /* a backslash escaped by the last chunk starts nothing */
            starts = bs & ~(bs << 1);
            even_ends = (bs + (starts & VR_EVEN_BITS)) & ~bs;
            esc = carry;
            carry = __builtin_uaddll_overflow(bs, starts & ~VR_EVEN_BITS, &odd_sum);
            odd_ends = (uint64_t)odd_sum & ~bs;
            esc |= (even_ends & ~VR_EVEN_BITS) | (odd_ends & VR_EVEN_BITS);
            quotes = quote & ~esc;
            before = quotes ? (quotes & (0 - quotes)) - 1 : ~0ULL;
            if (ctl & before)
                return NULL;
            ev = esc & before;
#if defined(VR_ESCMASKS64)
            if (ev) {
                /* All the escaped bytes at once: each must be one an escape names; then
                 * only the \u escapes need a closer look (their digits, surrogates). */
                uint64_t named, us;
                VR_ESCMASKS64(p, &named, &us);
                if (ev & ~named)
                    return NULL;
                ev &= us;
            }
#endif
            while (ev) {
                const unsigned char *x = p + __builtin_ctzll(ev);
                ev &= ev - 1;
                if (x < skip)
                    continue;
                if (*x == 'u') {
                    const unsigned char *q = x - 1;
                    if (vb_escape(&q, e, &cp) < 0)
                        return NULL;
                    skip = q;
                } else if (!vr_escape1[*x]) {
                    return NULL;
                }
            }
            if (quotes)
                return p + __builtin_ctzll(quotes) + 1;
            p += 64;
        }
        if (skip > p)
            p = skip;
        else if (carry) { /* the last chunk ended in a backslash: its escape first */
            const unsigned char *q = p - 1;
            if (vb_escape(&q, e, &cp) < 0)
                return NULL;
            p = q;
        }
    }
    return vr_string_tail(p, e);
}
