/*
 * Where a rendering goes (vb_sink): its bytes hashed into prefix_hash.h's chain of block
 * hashes as they come, fed by spans (whole blocks hashed where they lie, only the bytes
 * that straddle a block boundary copied), or kept as text (block 0); and what a call
 * hands back (vb_result). Included by prompt_render.h and blockscan.h (vb_hash_json).
 */
#ifndef VELOCITY_BLOCK_SINK_H
#define VELOCITY_BLOCK_SINK_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "byte_buf.h"
#include "prefix_hash.h"

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

typedef struct {
    uint64_t *hashes; /* malloc'd, n values (block > 0) */
    size_t n;
    unsigned char *text; /* malloc'd, len bytes (block 0) */
    size_t len;
} vb_result;

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

#endif /* VELOCITY_BLOCK_SINK_H */
