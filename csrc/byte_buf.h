/*
 * A growable byte buffer (vb_buf): what the JSON scanner decodes strings into
 * (json_scan.h), canonical JSON is written into (json_canon.h) and the sink keeps a
 * rendering in (block_sink.h). Header-only; realloc'd, doubled as it grows.
 */
#ifndef VELOCITY_BYTE_BUF_H
#define VELOCITY_BYTE_BUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    unsigned char *p;
    size_t len, cap;
} vb_buf;

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

#endif /* VELOCITY_BYTE_BUF_H */
