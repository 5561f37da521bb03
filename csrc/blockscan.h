/*
 * Prefix block hashes of a request straight from its JSON bytes: what
 * routing/blockscan.pyx includes. Two ways:
 *   vb_render (prompt_render.h): the prompt rendered as routing/prefix_render.py renders
 *     it, read by a strict JSON scanner (json_scan.h, json_canon.h), hashed by the sink
 *     (block_sink.h);
 *   vb_hash_json (here): the JSON text of a value as the client wrote it, less the
 *     whitespace between tokens.
 * Their leaves are json_lex.h's, shared with the request scanner (reqscan.h).
 */
#ifndef VELOCITY_BLOCKSCAN_H
#define VELOCITY_BLOCKSCAN_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_sink.h"
#include "json_lex.h"
#include "prefix_hash.h"
#include "prompt_render.h"

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
