/*
 * Prefix block hashes of a request straight from its JSON bytes.
 *
 * The rendering is routing/prefix_render.py's, byte for byte (that module is the
 * reference and says why it is what it is): chat messages one after another as
 *     0x1E role [0x1F "name:" name] 0x1F content [0x1F "tool_calls:" json] [0x1F "tool_call_id:" id]
 * content parts as their texts (0x1D "image:" url, 0x1D "audio:" data, 0x1D json for
 * others), a completions prompt as its text or its token ids (4 little-endian bytes
 * each), a batch by its first prompt. Strings are their decoded UTF-8; where the
 * reference writes canonical JSON (orjson, keys sorted) this writes the same bytes.
 *
 * One pass over the bytes, no object per message: a strict JSON scanner (RFC 8259 as
 * msgspec reads it: no trailing commas, valid UTF-8, no lone surrogates) walks the
 * body; each message's fields are rendered into a small arena (a string without
 * escapes is not copied, only named), then put, in the rendering's order, into the
 * sink: the block hasher of prefix_hash.h, fed by spans, which hashes full blocks in
 * place and copies only the bytes that straddle a block boundary.
 *
 * Anything it does not take (malformed JSON, nesting past VB_MAX_DEPTH, a float or an
 * integer past 64 bits where the reference would write canonical JSON, an allocation
 * that fails) returns -1: the caller then renders in Python, which costs time, never a
 * different route.
 */
#ifndef VELOCITY_BLOCKSCAN_H
#define VELOCITY_BLOCKSCAN_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "json_lex.h"
#include "prefix_hash.h"

/* What vb_render reads: a request body (a JSON object) or the raw `messages` array. */
#define VB_BODY 0
#define VB_MESSAGES 1

/* Containers nested deeper than this are left to the Python path (real messages nest
 * five or six levels; the bound also keeps the re-scans of canonical JSON linear). */
#define VB_MAX_DEPTH 64

typedef struct {
    unsigned char *p;
    size_t len, cap;
} vb_buf;

/* Where the rendering goes: block hashes (block > 0) or the bytes themselves (block 0). */
typedef struct {
    size_t block;
    vb_buf text;        /* block 0: the rendering */
    unsigned char *blk; /* the block being filled across spans */
    size_t fill;
    uint64_t seed, h;   /* h: the chain's state (prefix_hash.h), out[] its avalanches */
    uint64_t *out;
    size_t n, cap;
} vb_sink;

/* A rendered field: src[0..len) of the input (a string without escapes), else
 * arena[off..off+len). */
typedef struct {
    const unsigned char *src;
    size_t off, len;
} vb_seg;

typedef struct {
    const unsigned char *p, *end;
    int depth;
    vb_buf arena;  /* the current message's fields, rendered */
    vb_buf key;    /* the current key, when it has escapes */
    vb_buf prompt; /* the body's completions prompt, rendered */
    vb_sink sink;
} vb_scan;

typedef struct {
    uint64_t *hashes; /* malloc'd, n values (block > 0) */
    size_t n;
    unsigned char *text; /* malloc'd, len bytes (block 0) */
    size_t len;
} vb_result;

typedef struct {
    int is_int, neg, digits, big; /* big: the integer part is past 2**64 - 1 (v is not it) */
    uint64_t v;
} vb_num;

/* ---- buffers and the sink ------------------------------------------------------- */

static int vb_grow(vb_buf *b, size_t extra)
{
    size_t need = b->len + extra, cap = b->cap ? b->cap : 256;
    unsigned char *p;
    if (need < b->len)
        return -1;
    while (cap < need) {
        if (cap > SIZE_MAX / 2)
            return -1;
        cap *= 2;
    }
    p = (unsigned char *)realloc(b->p, cap);
    if (p == NULL)
        return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int vb_append(vb_buf *b, const void *src, size_t n)
{
    if (n == 0)
        return 0;
    if (b->cap - b->len < n && vb_grow(b, n) < 0)
        return -1;
    memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

static inline int vb_byte(vb_buf *b, unsigned char c)
{
    if (b->len == b->cap && vb_grow(b, 1) < 0)
        return -1;
    b->p[b->len++] = c;
    return 0;
}

static int vb_reserve_out(vb_sink *k, size_t more)
{
    size_t cap = k->cap ? k->cap : 64;
    uint64_t *out;
    while (cap - k->n < more) {
        if (cap > SIZE_MAX / 16)
            return -1;
        cap *= 2;
    }
    out = (uint64_t *)realloc(k->out, cap * sizeof(uint64_t));
    if (out == NULL)
        return -1;
    k->out = out;
    k->cap = cap;
    return 0;
}

/* The next n bytes of the rendering. Whole blocks are hashed where they lie. */
static int vb_put(vb_sink *k, const unsigned char *p, size_t n)
{
    size_t b = k->block, take, count;
    if (n == 0)
        return 0;
    if (b == 0)
        return vb_append(&k->text, p, n);
    if (k->fill) {
        take = b - k->fill;
        if (take > n)
            take = n;
        memcpy(k->blk + k->fill, p, take);
        k->fill += take;
        p += take;
        n -= take;
        if (k->fill < b)
            return 0;
        if (k->n == k->cap && vb_reserve_out(k, 1) < 0)
            return -1;
        k->h = vp_hash_run(k->blk, 1, b, k->h, k->out + k->n);
        k->n++;
        k->fill = 0;
    }
    count = n / b;
    if (count) {
        if (k->cap - k->n < count && vb_reserve_out(k, count) < 0)
            return -1;
        k->h = vp_hash_run(p, count, b, k->h, k->out + k->n);
        k->n += count;
        p += count * b;
        n -= count * b;
    }
    if (n) {
        memcpy(k->blk, p, n);
        k->fill = n;
    }
    return 0;
}

static void vb_sink_reset(vb_sink *k)
{
    k->text.len = 0;
    k->fill = 0;
    k->n = 0;
    k->h = k->seed;
}

static inline const unsigned char *vb_seg_ptr(const vb_scan *s, const vb_seg *g)
{
    return g->src ? g->src : s->arena.p + g->off;
}

static inline int vb_put_seg(vb_scan *s, const vb_seg *g)
{
    return vb_put(&s->sink, vb_seg_ptr(s, g), g->len);
}

#define VB_PUT_LIT(s, lit) vb_put(&(s)->sink, (const unsigned char *)(lit), sizeof(lit) - 1)
#define VB_IS(k, n, lit) ((n) == sizeof(lit) - 1 && memcmp((k), (lit), (n)) == 0)

/* ---- the scanner's leaves ------------------------------------------------------- */

static inline int vb_peek(vb_scan *s)
{
    const unsigned char *p = s->p, *e = s->end;
    while (p < e && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    s->p = p;
    return p < e ? *p : -1;
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

/* Decoded bytes (a key) into d as a JSON string body, escaped as orjson escapes. */
static int vb_put_json_bytes(vb_buf *d, const unsigned char *p, size_t n)
{
    size_t i, run = 0;
    for (i = 0; i < n; i++) {
        if (p[i] >= 0x20 && p[i] != '"' && p[i] != '\\')
            continue;
        if (vb_append(d, p + run, i - run) < 0 || vb_put_cp(d, p[i], 1) < 0)
            return -1;
        run = i + 1;
    }
    return vb_append(d, p + run, n - run);
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
 * The string at s->p (its opening quote), checked. Without d it is only checked. With d
 * its decoded text goes to d (json: re-escaped as orjson writes it): all of it when copy
 * is set, else only once an escape is met, and *g names the source when none is.
 */
static int vb_string(vb_scan *s, vb_buf *d, int copy, int json, vb_seg *g)
{
    const unsigned char *start = s->p + 1, *p = start, *run = start, *e = s->end;
    size_t off = d ? d->len : 0, n;
    int copying = d != NULL && copy;
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
        if (d == NULL) { /* checking only */
            if (vb_escape(&p, e, &cp) < 0)
                return -1;
            continue;
        }
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
    const unsigned char *p = s->p, *e = s->end;
    num->neg = 0;
    num->is_int = 1;
    num->digits = 0;
    num->big = 0;
    num->v = 0;
    if (p < e && *p == '-') {
        num->neg = 1;
        p++;
    }
    if (p >= e || *p < '0' || *p > '9')
        return -1;
    if (*p == '0') {
        p++;
        num->digits = 1;
    } else {
        for (; p < e && *p >= '0' && *p <= '9'; p++) {
            uint64_t d = (uint64_t)(*p - '0');
            if (num->v > (UINT64_MAX - d) / 10)
                num->big = 1;
            num->v = num->v * 10 + d;
            num->digits++;
        }
    }
    if (p < e && *p == '.') {
        num->is_int = 0;
        p++;
        if (p >= e || *p < '0' || *p > '9')
            return -1;
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        num->is_int = 0;
        p++;
        if (p < e && (*p == '+' || *p == '-'))
            p++;
        if (p >= e || *p < '0' || *p > '9')
            return -1;
        while (p < e && *p >= '0' && *p <= '9')
            p++;
    }
    s->p = p;
    return 0;
}

static inline int vb_literal(vb_scan *s, const char *w, size_t n)
{
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, w, n) != 0)
        return -1;
    s->p += n;
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

static int vb_skip(vb_scan *s)
{
    vb_seg g;
    vb_num num;
    const unsigned char *k;
    size_t kn;
    int r, c = vb_peek(s);
    switch (c) {
    case '"':
        return vb_string(s, NULL, 0, 0, &g);
    case '[':
        r = vb_open(s, ']');
        while (r > 0) {
            if (vb_skip(s) < 0)
                return -1;
            r = vb_next(s, ']');
        }
        return r;
    case '{':
        r = vb_open(s, '}');
        while (r > 0) {
            if (vb_key(s, &k, &kn) < 0 || vb_skip(s) < 0)
                return -1;
            r = vb_next(s, '}');
        }
        return r;
    case 't':
        return vb_literal(s, "true", 4);
    case 'f':
        return vb_literal(s, "false", 5);
    case 'n':
        return vb_literal(s, "null", 4);
    default:
        return vb_number(s, &num);
    }
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
        while (p < e && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
            p++;
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

/* ---- canonical JSON (orjson.dumps(value, option=OPT_SORT_KEYS)) ------------------ */

typedef struct {
    size_t koff, klen, idx;
    const unsigned char *key, *val;
} vb_member;

static int vb_member_cmp(const void *a, const void *b)
{
    const vb_member *x = (const vb_member *)a, *y = (const vb_member *)b;
    size_t n = x->klen < y->klen ? x->klen : y->klen;
    int c = n ? memcmp(x->key, y->key, n) : 0;
    if (c)
        return c;
    if (x->klen != y->klen)
        return x->klen < y->klen ? -1 : 1;
    return x->idx < y->idx ? -1 : (x->idx > y->idx);
}

static int vb_canon(vb_scan *s, vb_buf *d);

/* An object, keys sorted by their UTF-8 bytes (code point order), a repeated key
 * taking its last value, as a decoded dict would. */
static int vb_canon_object(vb_scan *s, vb_buf *d)
{
    vb_buf keys = {NULL, 0, 0}, mems = {NULL, 0, 0};
    vb_member m, *ms;
    const unsigned char *k, *after;
    size_t kn, count = 0, i;
    int r, first = 1, ok = -1;
    r = vb_open(s, '}');
    while (r > 0) {
        if (vb_key(s, &k, &kn) < 0)
            goto done;
        m.koff = keys.len;
        m.klen = kn;
        m.idx = count++;
        m.key = NULL;
        if (vb_append(&keys, k, kn) < 0)
            goto done;
        vb_peek(s);
        m.val = s->p;
        if (vb_skip(s) < 0 || vb_append(&mems, &m, sizeof m) < 0)
            goto done;
        r = vb_next(s, '}');
    }
    if (r < 0)
        goto done;
    after = s->p;
    ms = (vb_member *)mems.p;
    for (i = 0; i < count; i++)
        ms[i].key = keys.p + ms[i].koff;
    if (count > 1)
        qsort(ms, count, sizeof *ms, vb_member_cmp);
    if (vb_byte(d, '{') < 0)
        goto done;
    for (i = 0; i < count; i++) {
        if (i + 1 < count && ms[i].klen == ms[i + 1].klen
            && (ms[i].klen == 0 || memcmp(ms[i].key, ms[i + 1].key, ms[i].klen) == 0))
            continue; /* a later one of the same key wins */
        if (!first && vb_byte(d, ',') < 0)
            goto done;
        first = 0;
        if (vb_byte(d, '"') < 0 || vb_put_json_bytes(d, ms[i].key, ms[i].klen) < 0
            || vb_append(d, "\":", 2) < 0)
            goto done;
        s->p = ms[i].val;
        s->depth++;
        r = vb_canon(s, d);
        s->depth--;
        if (r < 0)
            goto done;
    }
    if (vb_byte(d, '}') < 0)
        goto done;
    s->p = after;
    ok = 0;
done:
    free(keys.p);
    free(mems.p);
    return ok;
}

static int vb_canon(vb_scan *s, vb_buf *d)
{
    const unsigned char *lit;
    vb_seg g;
    vb_num num;
    int r, c = vb_peek(s);
    switch (c) {
    case '"':
        if (vb_byte(d, '"') < 0 || vb_string(s, d, 1, 1, &g) < 0)
            return -1;
        return vb_byte(d, '"');
    case '[':
        if (vb_byte(d, '[') < 0)
            return -1;
        r = vb_open(s, ']');
        while (r > 0) {
            if (vb_canon(s, d) < 0)
                return -1;
            r = vb_next(s, ']');
            if (r > 0 && vb_byte(d, ',') < 0)
                return -1;
        }
        if (r < 0)
            return -1;
        return vb_byte(d, ']');
    case '{':
        return vb_canon_object(s, d);
    case 't':
        return vb_literal(s, "true", 4) < 0 ? -1 : vb_append(d, "true", 4);
    case 'f':
        return vb_literal(s, "false", 5) < 0 ? -1 : vb_append(d, "false", 5);
    case 'n':
        return vb_literal(s, "null", 4) < 0 ? -1 : vb_append(d, "null", 4);
    default:
        lit = s->p;
        /* Floats are written by orjson's shortest round trip: not reproduced here. An
         * integer past 64 bits orjson refuses (and the whole value renders as nothing). */
        if (vb_number(s, &num) < 0 || !num.is_int || num.big
            || (num.neg && num.v > (uint64_t)1 << 63))
            return -1;
        if (num.v == 0)
            return vb_byte(d, '0'); /* -0 is 0 */
        return vb_append(d, lit, (size_t)(s->p - lit));
    }
}

/* ---- the rendering -------------------------------------------------------------- */

/* prefix_render._text: a string's text, nothing for null, else canonical JSON; into the
 * arena (copy), or named in place when it is a string without escapes. */
static int vb_text(vb_scan *s, vb_seg *g, int copy)
{
    int c = vb_peek(s);
    if (c == '"')
        return vb_string(s, &s->arena, copy, 0, g);
    g->src = NULL;
    g->off = s->arena.len;
    if (c == 'n') {
        if (vb_literal(s, "null", 4) < 0)
            return -1;
    } else if (vb_canon(s, &s->arena) < 0) {
        return -1;
    }
    g->len = s->arena.len - g->off;
    return 0;
}

/* The value of the last member named `name` of the object at s->p (NULL: none, or not
 * an object); the object is consumed. */
static int vb_member_of(vb_scan *s, const char *name, size_t name_len, const unsigned char **val)
{
    const unsigned char *k;
    size_t kn;
    int r;
    *val = NULL;
    if (vb_peek(s) != '{')
        return vb_skip(s);
    r = vb_open(s, '}');
    while (r > 0) {
        if (vb_key(s, &k, &kn) < 0)
            return -1;
        if (kn == name_len && memcmp(k, name, kn) == 0) {
            vb_peek(s);
            *val = s->p;
        }
        if (vb_skip(s) < 0)
            return -1;
        r = vb_next(s, '}');
    }
    return r;
}

/* Re-read the value at v (checked before) as _text into the arena, then go on at end. */
static int vb_text_at(vb_scan *s, const unsigned char *v, const unsigned char *end)
{
    vb_seg g;
    int r;
    s->p = v;
    s->depth++;
    r = vb_text(s, &g, 1);
    s->depth--;
    s->p = end;
    return r;
}

enum { VB_PART_NONE, VB_PART_TEXT, VB_PART_IMAGE, VB_PART_AUDIO, VB_PART_OTHER };

/* One content part, appended to the arena. A text part's text is decoded in place as it
 * comes; the rest is decided when the part ends, as its keys may come in any order. */
static int vb_part(vb_scan *s)
{
    vb_buf *a = &s->arena;
    size_t mark = a->len, kn;
    const unsigned char *start, *k, *text = NULL, *image = NULL, *audio = NULL, *end, *url;
    int r, kind = VB_PART_NONE, text_done = 0;
    vb_seg g;
    r = vb_peek(s);
    start = s->p;
    if (r != '{') { /* not an object: its canonical JSON */
        if (vb_byte(a, 0x1D) < 0)
            return -1;
        return vb_canon(s, a);
    }
    r = vb_open(s, '}');
    while (r > 0) {
        if (vb_key(s, &k, &kn) < 0)
            return -1;
        if (VB_IS(k, kn, "type")) {
            kind = VB_PART_OTHER;
            if (vb_peek(s) == '"') {
                s->key.len = 0;
                if (vb_string(s, &s->key, 0, 0, &g) < 0)
                    return -1;
                k = g.src ? g.src : s->key.p + g.off;
                if (VB_IS(k, g.len, "text"))
                    kind = VB_PART_TEXT;
                else if (VB_IS(k, g.len, "image_url"))
                    kind = VB_PART_IMAGE;
                else if (VB_IS(k, g.len, "input_audio"))
                    kind = VB_PART_AUDIO;
            } else if (vb_skip(s) < 0) {
                return -1;
            }
        } else if (VB_IS(k, kn, "text")) {
            a->len = mark;
            if (vb_peek(s) == '"') {
                if (vb_string(s, a, 1, 0, &g) < 0)
                    return -1;
                text_done = 1;
            } else {
                text = s->p;
                text_done = 0;
                if (vb_skip(s) < 0)
                    return -1;
            }
        } else if (VB_IS(k, kn, "image_url")) {
            vb_peek(s);
            image = s->p;
            if (vb_skip(s) < 0)
                return -1;
        } else if (VB_IS(k, kn, "input_audio")) {
            vb_peek(s);
            audio = s->p;
            if (vb_skip(s) < 0)
                return -1;
        } else if (vb_skip(s) < 0) {
            return -1;
        }
        r = vb_next(s, '}');
    }
    if (r < 0)
        return -1;
    end = s->p;
    if (kind == VB_PART_TEXT) {
        if (text_done)
            return 0; /* the text is in place at mark */
        a->len = mark;
        return text ? vb_text_at(s, text, end) : 0;
    }
    a->len = mark;
    if (kind == VB_PART_IMAGE || kind == VB_PART_AUDIO) {
        const unsigned char *v = kind == VB_PART_IMAGE ? image : audio;
        if (kind == VB_PART_IMAGE ? vb_append(a, "\x1dimage:", 7) : vb_append(a, "\x1d" "audio:", 7))
            return -1;
        if (v == NULL)
            return 0;
        s->p = v;
        s->depth++;
        r = kind == VB_PART_IMAGE ? vb_member_of(s, "url", 3, &url) : vb_member_of(s, "data", 4, &url);
        s->depth--;
        s->p = end;
        if (r < 0)
            return -1;
        return url ? vb_text_at(s, url, end) : 0;
    }
    if (vb_byte(a, 0x1D) < 0)
        return -1;
    s->p = start;
    s->depth++;
    r = vb_canon(s, a);
    s->depth--;
    s->p = end;
    return r;
}

/* prefix_render._content into the arena. */
static int vb_content(vb_scan *s, vb_seg *g)
{
    int r;
    if (vb_peek(s) != '[')
        return vb_text(s, g, 0);
    g->src = NULL;
    g->off = s->arena.len;
    r = vb_open(s, ']');
    while (r > 0) {
        if (vb_part(s) < 0)
            return -1;
        r = vb_next(s, ']');
    }
    if (r < 0)
        return -1;
    g->len = s->arena.len - g->off;
    return 0;
}

/* An optional field (name, tool_calls, tool_call_id): rendered when truthy, else checked. */
static int vb_optional(vb_scan *s, vb_seg *g, int *present, int json)
{
    int t = vb_truthy(s);
    if (t < 0)
        return -1;
    *present = t;
    if (!t)
        return vb_skip(s);
    if (!json)
        return vb_text(s, g, 0);
    g->src = NULL;
    g->off = s->arena.len;
    if (vb_canon(s, &s->arena) < 0)
        return -1;
    g->len = s->arena.len - g->off;
    return 0;
}

/* One chat message into the sink. */
static int vb_message(vb_scan *s)
{
    vb_seg role = {NULL, 0, 0}, name = {NULL, 0, 0}, content = {NULL, 0, 0};
    vb_seg calls = {NULL, 0, 0}, call_id = {NULL, 0, 0};
    int has_name = 0, has_calls = 0, has_id = 0, r;
    const unsigned char *k;
    size_t kn;
    s->arena.len = 0;
    if (vb_peek(s) != '{') { /* not an object: no role, no content */
        if (vb_skip(s) < 0)
            return -1;
        return VB_PUT_LIT(s, "\x1e\x1f");
    }
    r = vb_open(s, '}');
    while (r > 0) {
        if (vb_key(s, &k, &kn) < 0)
            return -1;
        if (VB_IS(k, kn, "role"))
            r = vb_text(s, &role, 0);
        else if (VB_IS(k, kn, "content"))
            r = vb_content(s, &content);
        else if (VB_IS(k, kn, "name"))
            r = vb_optional(s, &name, &has_name, 0);
        else if (VB_IS(k, kn, "tool_calls"))
            r = vb_optional(s, &calls, &has_calls, 1);
        else if (VB_IS(k, kn, "tool_call_id"))
            r = vb_optional(s, &call_id, &has_id, 0);
        else
            r = vb_skip(s);
        if (r < 0)
            return -1;
        r = vb_next(s, '}');
    }
    if (r < 0)
        return -1;
    if (VB_PUT_LIT(s, "\x1e") < 0 || vb_put_seg(s, &role) < 0)
        return -1;
    if (has_name && (VB_PUT_LIT(s, "\x1fname:") < 0 || vb_put_seg(s, &name) < 0))
        return -1;
    if (VB_PUT_LIT(s, "\x1f") < 0 || vb_put_seg(s, &content) < 0)
        return -1;
    if (has_calls && (VB_PUT_LIT(s, "\x1ftool_calls:") < 0 || vb_put_seg(s, &calls) < 0))
        return -1;
    if (has_id && (VB_PUT_LIT(s, "\x1ftool_call_id:") < 0 || vb_put_seg(s, &call_id) < 0))
        return -1;
    return 0;
}

/* A non-empty messages array at s->p into the sink. */
static int vb_messages(vb_scan *s)
{
    int r = vb_open(s, ']');
    while (r > 0) {
        if (vb_message(s) < 0)
            return -1;
        r = vb_next(s, ']');
    }
    return r;
}

/* prefix_render.render_completion_prompt of the list at s->p, into d. */
static int vb_prompt_list(vb_scan *s, vb_buf *d)
{
    const unsigned char *list = s->p;
    size_t mark = d->len;
    unsigned char le[4];
    uint64_t v;
    vb_num num;
    vb_seg g;
    int c, r = vb_open(s, ']');
    if (r <= 0)
        return r; /* [] renders as nothing */
    c = vb_peek(s);
    if (c == '"' || c == '[') { /* the first prompt of a batch */
        if ((c == '"' ? vb_string(s, d, 1, 0, &g) : vb_prompt_list(s, d)) < 0)
            return -1;
        while ((r = vb_next(s, ']')) > 0)
            if (vb_skip(s) < 0)
                return -1;
        return r;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        /* Token ids (array('I'): ints, bools taken as 0 / 1, each within 32 bits). */
        for (;;) {
            c = vb_peek(s);
            if (c == 't' || c == 'f') {
                if (vb_literal(s, c == 't' ? "true" : "false", c == 't' ? 4 : 5) < 0)
                    return -1;
                v = c == 't';
            } else if (c == '-' || (c >= '0' && c <= '9')) {
                if (vb_number(s, &num) < 0)
                    return -1;
                if (!num.is_int || num.big || num.v > 0xFFFFFFFFu || (num.neg && num.v != 0))
                    break;
                v = num.v;
            } else {
                break;
            }
            le[0] = (unsigned char)v;
            le[1] = (unsigned char)(v >> 8);
            le[2] = (unsigned char)(v >> 16);
            le[3] = (unsigned char)(v >> 24);
            if (vb_append(d, le, 4) < 0)
                return -1;
            r = vb_next(s, ']');
            if (r <= 0)
                return r;
        }
    }
    /* Not token ids, nor a batch: the list's canonical JSON. */
    d->len = mark;
    s->p = list;
    s->depth--;
    return vb_canon(s, d);
}

/* A request body: `messages` when truthy, else `prompt` (prefix_render.render_prompt).
 * A non-empty messages array is rendered into the sink as it comes (a later repeat of
 * the key starts the sink over: the last one wins, as in the decoded body). */
static int vb_body(vb_scan *s)
{
    const unsigned char *k, *messages = NULL;
    size_t kn;
    int r, rendered = 0, t, c;
    vb_seg g;
    if (vb_peek(s) != '{')
        return -1;
    r = vb_open(s, '}');
    while (r > 0) {
        if (vb_key(s, &k, &kn) < 0)
            return -1;
        if (VB_IS(k, kn, "messages")) {
            vb_sink_reset(&s->sink);
            rendered = 0;
            vb_peek(s);
            messages = s->p;
            if (vb_truthy(s) == 1 && *s->p == '[') {
                if (vb_messages(s) < 0)
                    return -1;
                rendered = 1;
            } else if (vb_skip(s) < 0) {
                return -1;
            }
        } else if (VB_IS(k, kn, "prompt")) {
            s->prompt.len = 0;
            c = vb_peek(s);
            if (c == '"')
                r = vb_string(s, &s->prompt, 1, 0, &g);
            else if (c == '[')
                r = vb_prompt_list(s, &s->prompt);
            else if (c == 'n')
                r = vb_literal(s, "null", 4);
            else
                r = -1; /* not a str, a list or null: the decoder refuses it */
            if (r < 0)
                return -1;
        } else if (vb_skip(s) < 0) {
            return -1;
        }
        r = vb_next(s, '}');
    }
    if (r < 0)
        return -1;
    if (rendered)
        return 0;
    vb_sink_reset(&s->sink);
    if (messages != NULL) {
        const unsigned char *end = s->p;
        s->p = messages;
        t = vb_truthy(s);
        if (t < 0)
            return -1;
        if (t) { /* truthy and not a list: its _text */
            s->arena.len = 0;
            s->depth++;
            r = vb_text(s, &g, 1);
            s->depth--;
            s->p = end;
            return r < 0 ? -1 : vb_put_seg(s, &g);
        }
        s->p = end;
    }
    return vb_put(&s->sink, s->prompt.p, s->prompt.len);
}

/*
 * Render data (a body, or the messages array: what) and hash the rendering's full
 * blocks with prefix_hash.h's chain (block > 0, a multiple of VP_STRIPE), or return the
 * rendering itself (block 0). 0 and *res filled (the caller frees its buffers), or -1:
 * not taken (malformed, unsupported, or for VB_MESSAGES not a non-empty array).
 */
static int vb_render(const unsigned char *data, size_t len, int what, size_t block, uint64_t seed,
                     vb_result *res)
{
    vb_scan s;
    int rc = -1;
    memset(&s, 0, sizeof s);
    memset(res, 0, sizeof *res);
    if (data == NULL)
        return -1;
    s.p = data;
    s.end = data + len;
    s.sink.block = block;
    s.sink.seed = s.sink.h = seed;
    if (block) {
        if (block % VP_STRIPE)
            return -1;
        s.sink.cap = len / block + 16;
        s.sink.out = (uint64_t *)malloc(s.sink.cap * sizeof(uint64_t));
        s.sink.blk = (unsigned char *)malloc(block);
        if (s.sink.out == NULL || s.sink.blk == NULL)
            goto done;
    }
    if (what == VB_BODY)
        rc = vb_body(&s);
    else if (vb_peek(&s) == '[' && vb_truthy(&s) == 1)
        rc = vb_messages(&s);
    if (rc == 0 && vb_peek(&s) != -1)
        rc = -1; /* trailing bytes */
done:
    free(s.arena.p);
    free(s.key.p);
    free(s.prompt.p);
    free(s.sink.blk);
    if (rc < 0) {
        free(s.sink.out);
        free(s.sink.text.p);
        return -1;
    }
    res->hashes = s.sink.out;
    res->n = s.sink.n;
    res->text = s.sink.text.p;
    res->len = s.sink.text.len;
    return 0;
}

/* ---- the JSON text of a value, as the client wrote it ------------------------------ */

/*
 * Block hashes of a JSON value's text as the client wrote it, with the whitespace
 * between tokens left out, and without its last byte (the closing quote or bracket:
 * the next turn of a conversation writes a comma and more items there). So the same
 * conversation prefix gives the same blocks however long it grows, and whether the
 * client writes `, ` or `,`. Strings are taken as they are escaped: no decoding.
 *
 * data[0..len) must be one valid JSON value (the request scanner or the decoder
 * checked it); runs between whitespace are put into the sink whole. When the caller
 * knows there is no whitespace between its tokens (compact: the request decoder made
 * it so), the text is hashed where it lies without a walk, at the hash's own speed.
 * 0, or -1 when out of memory.
 */
static int vb_hash_json(const unsigned char *data, size_t len, int compact, size_t block, uint64_t seed,
                        vb_result *res)
{
    vb_sink k;
    const unsigned char *p = data, *e, *run;
    int rc = -1;
    memset(&k, 0, sizeof k);
    memset(res, 0, sizeof *res);
    if (block == 0 || block % VP_STRIPE)
        return -1;
    k.block = block;
    k.seed = k.h = seed;
    k.cap = len / block + 1;
    k.out = (uint64_t *)malloc(k.cap * sizeof(uint64_t));
    k.blk = (unsigned char *)malloc(block);
    if (k.out == NULL || k.blk == NULL)
        goto done;
    e = len ? data + len - 1 : data;
    run = p = data;
    while (!compact && (p = vb_next_space(p, e)) < e) {
        if (vb_put(&k, run, (size_t)(p - run)) < 0)
            goto done;
        run = p = vb_skip_space(p, e);
    }
    if (vb_put(&k, run, (size_t)(e - run)) < 0)
        goto done;
    rc = 0;
done:
    free(k.blk);
    if (rc < 0) {
        free(k.out);
        return -1;
    }
    res->hashes = k.out;
    res->n = k.n;
    return 0;
}

#endif /* VELOCITY_BLOCKSCAN_H */
