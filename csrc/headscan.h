/*
 * Runs of a header line's common bytes, 16 at a time, for velocity_fast/http/http1.pyx's
 * header scan (_headers).
 *
 * The scan reads a name byte by byte through the RFC 9110 tchar table and a value eight
 * bytes at a time. A client's head is mostly those bytes: the OpenAI SDKs send 15-20
 * header lines of 500-700 bytes, and the per-byte name loop was the biggest part of the
 * scan. These helpers skip the run of bytes that need no closer look, with SSE2 (every
 * x86-64), and leave the byte that ends the run to the scan's own loops, which decide
 * what it is (the ':' after a name, another tchar, the CR after a value, a byte that is
 * refused). So they change how fast the scan goes, never what it accepts.
 *
 * None reads past `n`: vectors are loaded only while 16 bytes remain.
 */
#ifndef VELOCITY_HEADSCAN_H
#define VELOCITY_HEADSCAN_H

#include <stddef.h>

#if defined(__SSE2__)
#include <emmintrin.h>

/* From s[pos]: the first position not in a run of letters, digits and '-' (the bytes of
 * nearly every header name), found 16 bytes at a time while 16 remain before n; the
 * rest (under 16 bytes, or the byte that ended the run) is the caller's. */
static inline ptrdiff_t hs_name_run(const char *s, ptrdiff_t pos, ptrdiff_t n)
{
    const __m128i a1 = _mm_set1_epi8('a' - 1), z1 = _mm_set1_epi8('z' + 1);
    const __m128i d1 = _mm_set1_epi8('0' - 1), n1 = _mm_set1_epi8('9' + 1);
    const __m128i dash = _mm_set1_epi8('-'), low = _mm_set1_epi8(0x20);
    while (pos + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + pos));
        __m128i l = _mm_or_si128(v, low); /* letters to lower case; no other byte onto one */
        /* signed compares: a byte past ASCII is negative, in no range */
        __m128i ok = _mm_or_si128(
            _mm_or_si128(_mm_and_si128(_mm_cmpgt_epi8(l, a1), _mm_cmpgt_epi8(z1, l)),
                         _mm_and_si128(_mm_cmpgt_epi8(v, d1), _mm_cmpgt_epi8(n1, v))),
            _mm_cmpeq_epi8(v, dash));
        unsigned m = (unsigned)_mm_movemask_epi8(ok) ^ 0xFFFFu;
        if (m)
            return pos + __builtin_ctz(m);
        pos += 16;
    }
    return pos;
}

/* From s[pos]: the first position not in a run of printable ASCII and spaces (0x20 to
 * 0x7e: nearly every byte of a header value), found 16 bytes at a time while 16 remain
 * before n. The byte that ends it (the CR, a tab, a byte refused) is the caller's. */
static inline ptrdiff_t hs_value_run(const char *s, ptrdiff_t pos, ptrdiff_t n)
{
    const __m128i sp = _mm_set1_epi8(0x20), del = _mm_set1_epi8(0x7f);
    while (pos + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + pos));
        /* below 0x20, or past ASCII (negative, signed), or DEL */
        __m128i bad = _mm_or_si128(_mm_cmpgt_epi8(sp, v), _mm_cmpeq_epi8(v, del));
        unsigned m = (unsigned)_mm_movemask_epi8(bad);
        if (m)
            return pos + __builtin_ctz(m);
        pos += 16;
    }
    return pos;
}

/* From s[pos]: the first position not in a run of a request-target's plain bytes
 * (visible ASCII but '?': a path), found 16 bytes at a time while 16 remain before n. */
static inline ptrdiff_t hs_path_run(const char *s, ptrdiff_t pos, ptrdiff_t n)
{
    const __m128i sp1 = _mm_set1_epi8(0x21), del = _mm_set1_epi8(0x7f), q = _mm_set1_epi8('?');
    while (pos + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + pos));
        /* a space or control byte, past ASCII (negative, signed), DEL, or '?' */
        __m128i end = _mm_or_si128(_mm_or_si128(_mm_cmpgt_epi8(sp1, v), _mm_cmpeq_epi8(v, del)),
                                   _mm_cmpeq_epi8(v, q));
        unsigned m = (unsigned)_mm_movemask_epi8(end);
        if (m)
            return pos + __builtin_ctz(m);
        pos += 16;
    }
    return pos;
}

#else

static inline ptrdiff_t hs_path_run(const char *s, ptrdiff_t pos, ptrdiff_t n)
{
    (void)s;
    (void)n;
    return pos;
}

static inline ptrdiff_t hs_name_run(const char *s, ptrdiff_t pos, ptrdiff_t n)
{
    (void)s;
    (void)n;
    return pos;
}

static inline ptrdiff_t hs_value_run(const char *s, ptrdiff_t pos, ptrdiff_t n)
{
    (void)s;
    (void)n;
    return pos;
}

#endif

#endif /* VELOCITY_HEADSCAN_H */
