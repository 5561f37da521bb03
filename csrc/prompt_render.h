/*
 * A request's prompt rendered straight from its JSON bytes (vb_render), into a sink
 * (block_sink.h): block hashes, or the rendering itself.
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
 *
 * Read with json_scan.h (canonical JSON: json_canon.h). Included by blockscan.h.
 */
#ifndef VELOCITY_PROMPT_RENDER_H
#define VELOCITY_PROMPT_RENDER_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_sink.h"
#include "byte_buf.h"
#include "json_canon.h"
#include "json_scan.h"
#include "prefix_hash.h"

/* What vb_render reads: a request body (a JSON object) or the raw `messages` array. */
#define VB_BODY 0
#define VB_MESSAGES 1

/* The rendering's state: the scanner's cursor, the current message's fields rendered,
 * the body's completions prompt and the sink. */
typedef struct {
    vb_scan s;
    vb_buf arena;  /* the current message's fields, rendered */
    vb_buf prompt; /* the body's completions prompt, rendered */
    vb_sink sink;
} vb_render_state;

static inline const unsigned char *vb_seg_ptr(const vb_render_state *rs, const vb_seg *g)
{
    return g->src ? g->src : rs->arena.p + g->off;
}

static inline int vb_put_seg(vb_render_state *rs, const vb_seg *g)
{
    return vb_put(&rs->sink, vb_seg_ptr(rs, g), g->len);
}

#define VB_PUT_LIT(rs, lit) vb_put(&(rs)->sink, (const unsigned char *)(lit), sizeof(lit) - 1)

/* ---- the rendering -------------------------------------------------------------- */

/* prefix_render._text: a string's text, nothing for null, else canonical JSON; into the
 * arena (copy), or named in place when it is a string without escapes. */
static int vb_text(vb_render_state *rs, vb_seg *g, int copy)
{
    vb_scan *s = &rs->s;
    int c = vb_peek(s);
    if (c == '"')
        return vb_string(s, &rs->arena, copy, 0, g);
    g->src = NULL;
    g->off = rs->arena.len;
    if (c == 'n') {
        if (vb_literal(s, "null", 4) < 0)
            return -1;
    } else if (vb_canon(s, &rs->arena) < 0) {
        return -1;
    }
    g->len = rs->arena.len - g->off;
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
static int vb_text_at(vb_render_state *rs, const unsigned char *v, const unsigned char *end)
{
    vb_scan *s = &rs->s;
    vb_seg g;
    int r;
    s->p = v;
    s->depth++;
    r = vb_text(rs, &g, 1);
    s->depth--;
    s->p = end;
    return r;
}

enum { VB_PART_NONE, VB_PART_TEXT, VB_PART_IMAGE, VB_PART_AUDIO, VB_PART_OTHER };

/* One content part, appended to the arena. A text part's text is decoded in place as it
 * comes; the rest is decided when the part ends, as its keys may come in any order. */
static int vb_part(vb_render_state *rs)
{
    vb_scan *s = &rs->s;
    vb_buf *a = &rs->arena;
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
        return text ? vb_text_at(rs, text, end) : 0;
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
        return url ? vb_text_at(rs, url, end) : 0;
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
static int vb_content(vb_render_state *rs, vb_seg *g)
{
    vb_scan *s = &rs->s;
    int r;
    if (vb_peek(s) != '[')
        return vb_text(rs, g, 0);
    g->src = NULL;
    g->off = rs->arena.len;
    r = vb_open(s, ']');
    while (r > 0) {
        if (vb_part(rs) < 0)
            return -1;
        r = vb_next(s, ']');
    }
    if (r < 0)
        return -1;
    g->len = rs->arena.len - g->off;
    return 0;
}

/* An optional field (name, tool_calls, tool_call_id): rendered when truthy, else checked. */
static int vb_optional(vb_render_state *rs, vb_seg *g, int *present, int json)
{
    vb_scan *s = &rs->s;
    int t = vb_truthy(s);
    if (t < 0)
        return -1;
    *present = t;
    if (!t)
        return vb_skip(s);
    if (!json)
        return vb_text(rs, g, 0);
    g->src = NULL;
    g->off = rs->arena.len;
    if (vb_canon(s, &rs->arena) < 0)
        return -1;
    g->len = rs->arena.len - g->off;
    return 0;
}

/* One chat message into the sink. */
static int vb_message(vb_render_state *rs)
{
    vb_scan *s = &rs->s;
    vb_seg role = {NULL, 0, 0}, name = {NULL, 0, 0}, content = {NULL, 0, 0};
    vb_seg calls = {NULL, 0, 0}, call_id = {NULL, 0, 0};
    int has_name = 0, has_calls = 0, has_id = 0, r;
    const unsigned char *k;
    size_t kn;
    rs->arena.len = 0;
    if (vb_peek(s) != '{') { /* not an object: no role, no content */
        if (vb_skip(s) < 0)
            return -1;
        return VB_PUT_LIT(rs, "\x1e\x1f");
    }
    r = vb_open(s, '}');
    while (r > 0) {
        if (vb_key(s, &k, &kn) < 0)
            return -1;
        if (VB_IS(k, kn, "role"))
            r = vb_text(rs, &role, 0);
        else if (VB_IS(k, kn, "content"))
            r = vb_content(rs, &content);
        else if (VB_IS(k, kn, "name"))
            r = vb_optional(rs, &name, &has_name, 0);
        else if (VB_IS(k, kn, "tool_calls"))
            r = vb_optional(rs, &calls, &has_calls, 1);
        else if (VB_IS(k, kn, "tool_call_id"))
            r = vb_optional(rs, &call_id, &has_id, 0);
        else
            r = vb_skip(s);
        if (r < 0)
            return -1;
        r = vb_next(s, '}');
    }
    if (r < 0)
        return -1;
    if (VB_PUT_LIT(rs, "\x1e") < 0 || vb_put_seg(rs, &role) < 0)
        return -1;
    if (has_name && (VB_PUT_LIT(rs, "\x1fname:") < 0 || vb_put_seg(rs, &name) < 0))
        return -1;
    if (VB_PUT_LIT(rs, "\x1f") < 0 || vb_put_seg(rs, &content) < 0)
        return -1;
    if (has_calls && (VB_PUT_LIT(rs, "\x1ftool_calls:") < 0 || vb_put_seg(rs, &calls) < 0))
        return -1;
    if (has_id && (VB_PUT_LIT(rs, "\x1ftool_call_id:") < 0 || vb_put_seg(rs, &call_id) < 0))
        return -1;
    return 0;
}

/* A non-empty messages array at s->p into the sink. */
static int vb_messages(vb_render_state *rs)
{
    vb_scan *s = &rs->s;
    int r = vb_open(s, ']');
    while (r > 0) {
        if (vb_message(rs) < 0)
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
static int vb_body(vb_render_state *rs)
{
    vb_scan *s = &rs->s;
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
            vb_sink_reset(&rs->sink);
            rendered = 0;
            vb_peek(s);
            messages = s->p;
            if (vb_truthy(s) == 1 && *s->p == '[') {
                if (vb_messages(rs) < 0)
                    return -1;
                rendered = 1;
            } else if (vb_skip(s) < 0) {
                return -1;
            }
        } else if (VB_IS(k, kn, "prompt")) {
            rs->prompt.len = 0;
            c = vb_peek(s);
            if (c == '"')
                r = vb_string(s, &rs->prompt, 1, 0, &g);
            else if (c == '[')
                r = vb_prompt_list(s, &rs->prompt);
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
    vb_sink_reset(&rs->sink);
    if (messages != NULL) {
        const unsigned char *end = s->p;
        s->p = messages;
        t = vb_truthy(s);
        if (t < 0)
            return -1;
        if (t) { /* truthy and not a list: its _text */
            rs->arena.len = 0;
            s->depth++;
            r = vb_text(rs, &g, 1);
            s->depth--;
            s->p = end;
            return r < 0 ? -1 : vb_put_seg(rs, &g);
        }
        s->p = end;
    }
    return vb_put(&rs->sink, rs->prompt.p, rs->prompt.len);
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
    vb_render_state rs;
    int rc = -1;
    memset(&rs, 0, sizeof rs);
    memset(res, 0, sizeof *res);
    if (data == NULL)
        return -1;
    rs.s.p = data;
    rs.s.end = data + len;
    rs.sink.block = block;
    rs.sink.seed = rs.sink.h = seed;
    if (block) {
        if (block % VP_STRIPE)
            return -1;
        rs.sink.cap = len / block + 16;
        rs.sink.out = (uint64_t *)malloc(rs.sink.cap * sizeof(uint64_t));
        rs.sink.blk = (unsigned char *)malloc(block);
        if (rs.sink.out == NULL || rs.sink.blk == NULL)
            goto done;
    }
    if (what == VB_BODY)
        rc = vb_body(&rs);
    else if (vb_peek(&rs.s) == '[' && vb_truthy(&rs.s) == 1)
        rc = vb_messages(&rs);
    if (rc == 0 && vb_peek(&rs.s) != -1)
        rc = -1; /* trailing bytes */
done:
    free(rs.arena.p);
    free(rs.s.key.p);
    free(rs.prompt.p);
    free(rs.sink.blk);
    if (rc < 0) {
        free(rs.sink.out);
        free(rs.sink.text.p);
        return -1;
    }
    res->hashes = rs.sink.out;
    res->n = rs.sink.n;
    res->text = rs.sink.text.p;
    res->len = rs.sink.text.len;
    return 0;
}

#endif /* VELOCITY_PROMPT_RENDER_H */
