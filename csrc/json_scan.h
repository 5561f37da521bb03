/*
 * A strict JSON scanner (RFC 8259 as msgspec reads it: no trailing commas, valid UTF-8,
 * no lone surrogates) over a cursor (vb_scan): strings checked or decoded (in place when
 * they have no escapes), numbers, literals, containers opened and walked member by
 * member, values skipped (json_skip.h's walk, which the request scanner shares), and
 * Python's truth of a value. Its leaves are json_lex.h's.
 * Included by json_canon.h and prompt_render.h. Header-only.
 */
#ifndef VELOCITY_JSON_SCAN_H
#define VELOCITY_JSON_SCAN_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "byte_buf.h"
#include "json_lex.h"


/* Containers nested deeper than this are left to the Python path (real messages nest
 * five or six levels; the bound also keeps the re-scans of canonical JSON linear). */
#define VB_MAX_DEPTH 64

/* A decoded string: src[0..len) of the input (a string without escapes), else
 * off..off+len of the buffer it was decoded into. */
typedef struct {
    const unsigned char *src;
    size_t off, len;
} vb_seg;

/* Where the scanner is. */
typedef struct {
    const unsigned char *p, *end;
    int depth;
    vb_buf key; /* the current key, when it has escapes */
} vb_scan;

#define VB_IS(k, n, lit) ((n) == sizeof(lit) - 1 && memcmp((k), (lit), (n)) == 0)

/* ---- the scanner's leaves ------------------------------------------------------- */

static inline int vb_peek(vb_scan *s)
{
    const unsigned char *p = vb_skip_space(s->p, s->end);
    s->p = p;
    return p < s->end ? *p : -1;
}


/* The byte a one-letter escape stands for (0: not one; \\u is handled apart). */
static const unsigned char vb_unescape[256] = {
    ['"'] = '"', ['\\'] = '\\', ['/'] = '/', ['b'] = '\b', ['f'] = '\f', ['n'] = '\n', ['r'] = '\r', ['t'] = '\t',
};

/* cp as UTF-8 at out (room for 4 bytes); its length. */
static inline size_t vb_utf8_put(unsigned char *u, uint32_t cp)
{
    if (cp < 0x80) {
        u[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        u[0] = (unsigned char)(0xC0 | (cp >> 6));
        u[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        u[0] = (unsigned char)(0xE0 | (cp >> 12));
        u[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    u[0] = (unsigned char)(0xF0 | (cp >> 18));
    u[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    u[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A decoded code point into d: as UTF-8, or (json) re-escaped where orjson escapes. */
static int vb_put_cp(vb_buf *d, uint32_t cp, int json)
{
    unsigned char u[6];
    size_t n;
    static const char hex[] = "0123456789abcdef";
    if (json && (cp < 0x20 || cp == '"' || cp == '\\')) {
        u[0] = '\\';
        switch (cp) {
        case '"': u[1] = '"'; return vb_append(d, u, 2);
        case '\\': u[1] = '\\'; return vb_append(d, u, 2);
        case '\b': u[1] = 'b'; return vb_append(d, u, 2);
        case '\t': u[1] = 't'; return vb_append(d, u, 2);
        case '\n': u[1] = 'n'; return vb_append(d, u, 2);
        case '\f': u[1] = 'f'; return vb_append(d, u, 2);
        case '\r': u[1] = 'r'; return vb_append(d, u, 2);
        default:
            u[1] = 'u';
            u[2] = '0';
            u[3] = '0';
            u[4] = (unsigned char)hex[cp >> 4];
            u[5] = (unsigned char)hex[cp & 15];
            return vb_append(d, u, 6);
        }
    }
    n = vb_utf8_put(u, cp);
    return vb_append(d, u, n);
}


/*
 * vb_string's copy into d once it must copy: [start, p) as it is, then from p on one
 * pass that stores each 16-byte chunk at once (the scan and the copy fused; a chunk's
 * bytes past a special one are overwritten by what follows) and writes escapes in place.
 */
static int vb_string_copy(vb_scan *s, vb_buf *d, const unsigned char *start, const unsigned char *p,
                          vb_seg *g)
{
    const unsigned char *e = s->end;
    size_t off = d->len, n, i;
    uint32_t cp;
    unsigned char c, x, *q, *qend; /* the write cursor and the end of d's room: locals, */
#if defined(__SSE2__)                /* as stores through q could be d->len for the compiler */
    const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'), space = _mm_set1_epi8(0x20);
#endif
    if (vb_append(d, start, (size_t)(p - start)) < 0 || (d->cap - d->len < 32 && vb_grow(d, 32) < 0))
        return -1;
    q = d->p + d->len;
    qend = d->p + d->cap;
    for (;;) {
        /* Room for a chunk and an escape's bytes after it. */
        if (qend - q < 32) {
            d->len = (size_t)(q - d->p);
            if (vb_grow(d, 32) < 0)
                return -1;
            q = d->p + d->len;
            qend = d->p + d->cap;
        }
#if defined(__SSE2__)
        if (e - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            int mask;
            _mm_storeu_si128((__m128i *)q, v);
            mask = _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)),
                                                  _mm_cmplt_epi8(v, space)));
            if (mask == 0) {
                p += 16;
                q += 16;
                continue;
            }
            n = (size_t)__builtin_ctz((unsigned)mask);
            p += n;
            q += n;
        } else
#endif
        {
            for (i = 0; i < 16 && p < e && vb_plain[*p]; i++)
                *q++ = *p++;
            if (i == 16)
                continue;
            if (p >= e)
                return -1;
        }
        c = *p;
        if (c == '"')
            break;
        if (c >= 0x80) { /* and the next ones, as long as they come (another script) */
            do {
                n = vb_utf8(p, e);
                if (n == 0)
                    return -1;
                if (qend - q < 4) {
                    d->len = (size_t)(q - d->p);
                    if (vb_grow(d, 32) < 0)
                        return -1;
                    q = d->p + d->len;
                    qend = d->p + d->cap;
                }
                for (i = 0; i < n; i++)
                    q[i] = p[i];
                q += n;
                p += n;
            } while (p < e && *p >= 0x80);
            continue;
        }
        if (c != '\\')
            return -1; /* a raw control byte */
        x = p + 1 < e ? vb_unescape[p[1]] : 0;
        if (x) {
            *q++ = x;
            p += 2;
            continue;
        }
        do { /* \\u escapes, as long as they come (text in another script, ASCII-escaped) */
            if (vb_escape(&p, e, &cp) < 0)
                return -1;
            if (qend - q < 4) {
                d->len = (size_t)(q - d->p);
                if (vb_grow(d, 32) < 0)
                    return -1;
                q = d->p + d->len;
                qend = d->p + d->cap;
            }
            q += vb_utf8_put(q, cp);
        } while (e - p >= 6 && p[0] == '\\' && p[1] == 'u');
    }
    d->len = (size_t)(q - d->p);
    g->src = NULL;
    g->off = off;
    g->len = d->len - off;
    s->p = p + 1;
    return 0;
}

/*
 * The string at s->p (its opening quote), checked, its decoded text into d (json:
 * re-escaped as orjson writes it): all of it when copy is set, else only once an escape
 * is met, and *g names the source when none is. (Checked only: vb_string_end.)
 */
static int vb_string(vb_scan *s, vb_buf *d, int copy, int json, vb_seg *g)
{
    const unsigned char *start = s->p + 1, *p = start, *run = start, *e = s->end;
    size_t off = d->len, n;
    int copying = copy;
    uint32_t cp;
    if (copying && !json)
        return vb_string_copy(s, d, start, start, g);
    for (;;) {
        p = vb_find_special(p, e, 1);
        if (p >= e)
            return -1;
        if (*p == '"')
            break;
        if (*p >= 0x80) {
            do {
                n = vb_utf8(p, e);
                if (n == 0)
                    return -1;
                p += n;
            } while (p < e && *p >= 0x80);
            continue;
        }
        if (*p != '\\')
            return -1; /* a raw control byte */
        if (!json)
            return vb_string_copy(s, d, start, p, g); /* (nothing copied yet) */
        /* The run before the escape, then what it stands for: room for both at once. */
        copying = 1;
        n = (size_t)(p - run);
        if (d->cap - d->len < n + 8 && vb_grow(d, n + 8) < 0)
            return -1;
        memcpy(d->p + d->len, run, n);
        d->len += n;
        if (!json && p + 1 < e && vb_unescape[p[1]]) {
            d->p[d->len++] = vb_unescape[p[1]];
            p += 2;
        } else {
            if (vb_escape(&p, e, &cp) < 0)
                return -1;
            if (json) {
                if (vb_put_cp(d, cp, 1) < 0)
                    return -1;
            } else {
                d->len += vb_utf8_put(d->p + d->len, cp);
            }
        }
        run = p;
    }
    if (copying) {
        if (vb_append(d, run, (size_t)(p - run)) < 0)
            return -1;
        g->src = NULL;
        g->off = off;
        g->len = d->len - off;
    } else {
        g->src = start;
        g->off = 0;
        g->len = (size_t)(p - start);
    }
    s->p = p + 1;
    return 0;
}

/* A JSON number at s->p, checked; what it is in *num. */
static int vb_number(vb_scan *s, vb_num *num)
{
    const unsigned char *q = vb_number_end(s->p, s->end, num);
    if (q == NULL)
        return -1;
    s->p = q;
    return 0;
}

static inline int vb_literal(vb_scan *s, const char *w, size_t n)
{
    const unsigned char *q = vb_word(s->p, s->end, w, n);
    if (q == NULL)
        return -1;
    s->p = q;
    return 0;
}

/* ---- containers ----------------------------------------------------------------- */

/* At '{' or '[': 1 when a member follows, 0 when it is empty (and consumed). */
static int vb_open(vb_scan *s, int close)
{
    if (++s->depth > VB_MAX_DEPTH)
        return -1;
    s->p++;
    if (vb_peek(s) == close) {
        s->p++;
        s->depth--;
        return 0;
    }
    return 1;
}

/* After a member: 1 when another follows, 0 at the end (consumed). */
static inline int vb_next(vb_scan *s, int close)
{
    int c = vb_peek(s);
    if (c == ',') {
        s->p++;
        return 1;
    }
    if (c == close) {
        s->p++;
        s->depth--;
        return 0;
    }
    return -1;
}

/* A member's key and its ':'; *k names the decoded key (valid until the next key). */
static int vb_key(vb_scan *s, const unsigned char **k, size_t *n)
{
    vb_seg g;
    if (vb_peek(s) != '"')
        return -1;
    s->key.len = 0;
    if (vb_string(s, &s->key, 0, 0, &g) < 0)
        return -1;
    *k = g.src ? g.src : s->key.p + g.off;
    *n = g.len;
    if (vb_peek(s) != ':')
        return -1;
    s->p++;
    return 0;
}

/* One value checked and passed (json_skip.h's walk, with vb_string_end: strings checked
 * as this scanner reads them), within what is left of VB_MAX_DEPTH. */
#define JSON_SKIP vb_skip_value
#define JSON_SKIP_STRING vb_string_end
#define JSON_SKIP_STACK VB_MAX_DEPTH
#include "json_skip.h"
#undef JSON_SKIP
#undef JSON_SKIP_STRING
#undef JSON_SKIP_STACK

static int vb_skip(vb_scan *s)
{
    const unsigned char *q;
    int spaced;
    vb_peek(s);
    q = vb_skip_value(s->p, s->end, VB_MAX_DEPTH - s->depth, &spaced);
    if (q == NULL)
        return -1;
    s->p = q;
    return 0;
}

/* Python's truth of the value at s->p (not consumed): 1, 0, or -1 for a float (whose
 * rendering is not ours anyway) or what is not a value. */
static int vb_truthy(vb_scan *s)
{
    int c = vb_peek(s);
    const unsigned char *p = s->p + 1, *e = s->end;
    vb_scan t;
    vb_num num;
    switch (c) {
    case '"':
        return p < e && *p != '"';
    case '[':
    case '{':
        p = vb_skip_space(p, e);
        return p < e && *p != (c == '[' ? ']' : '}');
    case 't':
        return 1;
    case 'f':
    case 'n':
        return 0;
    default:
        t = *s;
        if (vb_number(&t, &num) < 0 || !num.is_int)
            return -1;
        return !(num.digits == 1 && num.v == 0);
    }
}

#endif /* VELOCITY_JSON_SCAN_H */
