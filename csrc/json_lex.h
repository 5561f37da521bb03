/*
 * The leaves of a strict JSON scanner (RFC 8259 as msgspec reads it), shared by the
 * request scanner (reqscan.h: the gateway's fields) and the renderer's scanner
 * (json_scan.h, under blockscan.h: prefix blocks), and by the value walk both use
 * (json_skip.h): the plain-run search inside strings, UTF-8 and escape validation,
 * whitespace, numbers (checked, or read too), literals, and the strict string check.
 * Header-only, no allocation.
 */
#ifndef VELOCITY_JSON_LEX_H
#define VELOCITY_JSON_LEX_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>

#endif

/* Bytes a string's plain run may hold: printable ASCII but the quote and the backslash. */
static const unsigned char vb_plain[256] = {
#define VB_R16(x) x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x
    VB_R16(0), VB_R16(0),
    1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, /* 0x20: '"' */
    VB_R16(1), VB_R16(1),
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, /* 0x50: '\\' */
    VB_R16(1), VB_R16(1),
    VB_R16(0), VB_R16(0), VB_R16(0), VB_R16(0), VB_R16(0), VB_R16(0), VB_R16(0), VB_R16(0),
#undef VB_R16
};

/* The first byte at or after p that ends a plain run of a string (end when there is
 * none): '"', '\\', a control byte, and when ascii (a constant at each call) any byte
 * >= 0x80 too. 16 bytes a step where SSE2 is there. The renderer stops at non-ASCII to
 * check its UTF-8; the request scanner passes it, as msgspec leaves the UTF-8 of strings
 * it skips unchecked (the engine decodes the prompt). */
static inline const unsigned char *vb_find_special(const unsigned char *p, const unsigned char *e, int ascii)
{
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\');
    const __m128i space = _mm_set1_epi8(0x20), c1f = _mm_set1_epi8(0x1F);
    while (e - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        /* a signed compare with 0x20 catches the control bytes and those >= 0x80 at once */
        __m128i low = ascii ? _mm_cmplt_epi8(v, space) : _mm_cmpeq_epi8(_mm_max_epu8(v, c1f), c1f);
        __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)), low);
        int mask = _mm_movemask_epi8(m);
        if (mask)
            return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    if (ascii)
        while (p < e && vb_plain[*p])
            p++;
    else
        while (p < e && *p != '"' && *p != '\\' && *p >= 0x20)
            p++;
    return p;
}

/* Length of the valid UTF-8 sequence at p (non-ASCII lead byte), 0 when invalid:
 * no overlong forms, no surrogates, nothing past U+10FFFF. */
static inline size_t vb_utf8(const unsigned char *p, const unsigned char *e)
{
    unsigned c = p[0], c1;
    if (c < 0xC2)
        return 0;
    if (c < 0xE0)
        return (e - p >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c < 0xF0) {
        if (e - p < 3)
            return 0;
        c1 = p[1];
        if ((c1 & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80)
            return 0;
        if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0))
            return 0;
        return 3;
    }
    if (c < 0xF5) {
        if (e - p < 4)
            return 0;
        c1 = p[1];
        if ((c1 & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80)
            return 0;
        if ((c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90))
            return 0;
        return 4;
    }
    return 0;
}

/* A hex digit's value, 16 when it is none. */
static inline uint32_t vb_hexd(unsigned c)
{
    uint32_t d = (uint32_t)c - '0', l = ((uint32_t)c | 0x20) - 'a';
    return d < 10 ? d : l < 6 ? l + 10 : 16;
}

static inline int vb_hex4(const unsigned char *p, uint32_t *out)
{
    uint32_t a = vb_hexd(p[0]), b = vb_hexd(p[1]), c = vb_hexd(p[2]), d = vb_hexd(p[3]);
    if ((a | b | c | d) & 16)
        return -1;
    *out = (a << 12) | (b << 8) | (c << 4) | d;
    return 0;
}

/* The escape at *pp (its backslash): its code point, *pp moved past it. A high
 * surrogate must be followed by a low one (msgspec refuses anything else). */
static int vb_escape(const unsigned char **pp, const unsigned char *e, uint32_t *cp)
{
    const unsigned char *p = *pp;
    uint32_t lo;
    if (e - p < 2)
        return -1;
    switch (p[1]) {
    case '"': *cp = '"'; break;
    case '\\': *cp = '\\'; break;
    case '/': *cp = '/'; break;
    case 'b': *cp = '\b'; break;
    case 'f': *cp = '\f'; break;
    case 'n': *cp = '\n'; break;
    case 'r': *cp = '\r'; break;
    case 't': *cp = '\t'; break;
    case 'u':
        if (e - p < 6 || vb_hex4(p + 2, cp) < 0)
            return -1;
        if (*cp >= 0xDC00 && *cp <= 0xDFFF)
            return -1;
        if (*cp >= 0xD800 && *cp <= 0xDBFF) {
            if (e - p < 12 || p[6] != '\\' || p[7] != 'u' || vb_hex4(p + 8, &lo) < 0 || lo < 0xDC00
                || lo > 0xDFFF)
                return -1;
            *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
            *pp = p + 12;
            return 0;
        }
        *pp = p + 6;
        return 0;
    default:
        return -1;
    }
    *pp = p + 2;
    return 0;
}

/* The first '"' or '\\' at or after p (e when there is none). */
static inline const unsigned char *vb_quote_or_escape(const unsigned char *p, const unsigned char *e)
{
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\');
    while (e - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        int mask = _mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)));
        if (mask)
            return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    while (p < e && *p != '"' && *p != '\\')
        p++;
    return p;
}

/* The first '"' or whitespace byte at or after p, outside strings (e when there is
 * none). In valid JSON no byte there is a control or non-ASCII one, so a signed compare
 * with 0x21 finds the whitespace. */
static inline const unsigned char *vb_quote_or_space(const unsigned char *p, const unsigned char *e)
{
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), bang = _mm_set1_epi8(0x21);
    while (e - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        int mask = _mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmplt_epi8(v, bang)));
        if (mask)
            return p + __builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    while (p < e && *p != '"' && (*p > 0x20 && *p < 0x80))
        p++;
    return p;
}

/* In valid JSON text, from p outside a string: the first whitespace byte outside
 * strings (e when there is none). Strings are skipped at SIMD speed. */
static inline const unsigned char *vb_next_space(const unsigned char *p, const unsigned char *e)
{
    for (;;) {
        p = vb_quote_or_space(p, e);
        if (p >= e)
            return e;
        if (*p != '"')
            return p;
        p++;
        for (;;) {
            p = vb_quote_or_escape(p, e);
            if (p >= e)
                return e;
            if (*p == '"')
                break;
            p += 2; /* an escape: its second byte is never the string's end */
        }
        p++;
    }
}

/* Past the whitespace at p. */
static inline const unsigned char *vb_skip_space(const unsigned char *p, const unsigned char *e)
{
    while (p < e && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

/* A JSON number as the renderer reads it. */
typedef struct {
    int is_int, neg, digits, big; /* big: the integer part is past 2**64 - 1 (v is not it) */
    uint64_t v;
} vb_num;

/* The number at p: one past it, NULL when it is not one (JSON's grammar exactly). With
 * num, what it is too (NULL: checked only, the value work folded away). */
static inline const unsigned char *vb_number_end(const unsigned char *p, const unsigned char *e, vb_num *num)
{
    if (num) {
        num->neg = 0;
        num->is_int = 1;
        num->digits = 0;
        num->big = 0;
        num->v = 0;
    }
    if (p < e && *p == '-') {
        if (num)
            num->neg = 1;
        p++;
    }
    if (p >= e || *p < '0' || *p > '9')
        return NULL;
    if (*p == '0') {
        p++;
        if (num)
            num->digits = 1;
    } else if (num) {
        for (; p < e && *p >= '0' && *p <= '9'; p++) {
            uint64_t d = (uint64_t)(*p - '0');
            if (num->v > (UINT64_MAX - d) / 10)
                num->big = 1;
            num->v = num->v * 10 + d;
            num->digits++;
        }
    } else {
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < e && *p == '.') {
        if (num)
            num->is_int = 0;
        p++;
        if (p >= e || *p < '0' || *p > '9')
            return NULL;
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        if (num)
            num->is_int = 0;
        p++;
        if (p < e && (*p == '+' || *p == '-'))
            p++;
        if (p >= e || *p < '0' || *p > '9')
            return NULL;
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    return p;
}

/* The literal w (n bytes: true, false, null) at p: one past it, NULL when it is not there. */
static inline const unsigned char *vb_word(const unsigned char *p, const unsigned char *e, const char *w, size_t n)
{
    return (size_t)(e - p) >= n && memcmp(p, w, n) == 0 ? p + n : NULL;
}

/* The string at p (its opening quote), checked as the renderer reads strings: one past
 * its closing quote, NULL when invalid (a control byte, an escape the grammar does not
 * have, a lone surrogate, and unlike the request scanner's walk, invalid UTF-8). */
static inline const unsigned char *vb_string_end(const unsigned char *p, const unsigned char *e)
{
    uint32_t cp;
    size_t n;
    p++;
    for (;;) {
        p = vb_find_special(p, e, 1);
        if (p >= e)
            return NULL;
        if (*p == '"')
            return p + 1;
        if (*p >= 0x80) {
            do {
                n = vb_utf8(p, e);
                if (n == 0)
                    return NULL;
                p += n;
            } while (p < e && *p >= 0x80);
            continue;
        }
        if (*p != '\\')
            return NULL; /* a raw control byte */
        if (vb_escape(&p, e, &cp) < 0)
            return NULL;
    }
}

#endif
