/*
 * Canonical JSON: a value re-written as orjson.dumps(value, option=OPT_SORT_KEYS) writes
 * it (keys sorted by code point, a repeated key's last value, no whitespace, strings
 * escaped as orjson escapes), read with json_scan.h. Floats and integers past 64 bits are
 * not taken (-1). Included by prompt_render.h. Header-only.
 */
#ifndef VELOCITY_JSON_CANON_H
#define VELOCITY_JSON_CANON_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "byte_buf.h"
#include "json_scan.h"

/* ---- canonical JSON (orjson.dumps(value, option=OPT_SORT_KEYS)) ------------------ */

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

#endif /* VELOCITY_JSON_CANON_H */
