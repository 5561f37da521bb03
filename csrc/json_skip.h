/*
 * A template: one JSON value walked and checked, not decoded (the skip both scanners
 * share). Included once by reqscan.h (vr_value: strings walked as msgspec leaves them,
 * UTF-8 unchecked) and once by json_scan.h (vb_skip_value: strings checked as the
 * renderer reads them, UTF-8 too), each with
 *   JSON_SKIP          the function's name,
 *   JSON_SKIP_STRING   the string walk: p at its opening quote, one past its closing
 *                      quote back, NULL when invalid,
 *   JSON_SKIP_STACK    the most containers a call may hold open,
 * and optionally
 *   JSON_SKIP_CTX      the type of one more argument, passed on to each string walk
 *                      (reqscan.h: where the walk digests the prompt's blocks).
 * Numbers, literals and whitespace are json_lex.h's.
 */
#include "json_lex.h"

/* Whitespace skipped inside a value: noted in *spaced. */
#define JSON_SKIP_WS(p)                                  \
    do {                                                 \
        const unsigned char *w_ = vb_skip_space((p), e); \
        sp |= w_ != (p);                                 \
        (p) = w_;                                        \
    } while (0)

/* The value at p (no whitespace before it): one past it, NULL when invalid or nested
 * past depth levels; *spaced set when there is whitespace between its tokens.
 * Iterative: a stack of the open containers' kinds. */
#if defined(JSON_SKIP_CTX)
#define JSON_SKIP_STR(p) JSON_SKIP_STRING((p), e, ctx)
static const unsigned char *JSON_SKIP(const unsigned char *p, const unsigned char *e, int depth, int *spaced,
                                      JSON_SKIP_CTX ctx)
#else
#define JSON_SKIP_STR(p) JSON_SKIP_STRING((p), e)
static const unsigned char *JSON_SKIP(const unsigned char *p, const unsigned char *e, int depth, int *spaced)
#endif
{
    unsigned char open[JSON_SKIP_STACK];
    int d = 0, sp = 0;
value:
    if (p >= e)
        return NULL;
    switch (*p) {
    case '"':
        p = JSON_SKIP_STR(p);
        break;
    case '{':
        if (d >= depth)
            return NULL;
        open[d++] = '}';
        p++;
        JSON_SKIP_WS(p);
        if (p < e && *p == '}') {
            p++;
            d--;
            goto after;
        }
        goto key;
    case '[':
        if (d >= depth)
            return NULL;
        open[d++] = ']';
        p++;
        JSON_SKIP_WS(p);
        if (p < e && *p == ']') {
            p++;
            d--;
            goto after;
        }
        goto value;
    case 't':
        p = vb_word(p, e, "true", 4);
        break;
    case 'f':
        p = vb_word(p, e, "false", 5);
        break;
    case 'n':
        p = vb_word(p, e, "null", 4);
        break;
    default:
        p = vb_number_end(p, e, NULL);
    }
    if (p == NULL)
        return NULL;
after:
    if (d == 0) {
        *spaced = sp;
        return p;
    }
    JSON_SKIP_WS(p);
    if (p >= e)
        return NULL;
    if (*p == ',') {
        p++;
        JSON_SKIP_WS(p);
        if (open[d - 1] == ']')
            goto value;
        goto key;
    }
    if (*p != open[d - 1])
        return NULL;
    p++;
    d--;
    goto after;
key:
    if (p >= e || *p != '"')
        return NULL;
    p = JSON_SKIP_STR(p);
    if (p == NULL)
        return NULL;
    JSON_SKIP_WS(p);
    if (p >= e || *p != ':')
        return NULL;
    p++;
    JSON_SKIP_WS(p);
    goto value;
}

#undef JSON_SKIP_WS
#undef JSON_SKIP_STR
