/*
 * A template, included by reqscan.h once per instruction set, with VR_STRING (the
 * function's name) and VR_MASKS64 (its 64-byte mask reader) defined. No include guard.
 *
 * The string at p (its opening quote): one past its closing quote, NULL when invalid
 * (a control byte, an escape the grammar does not have, a lone surrogate).
 *
 * Prompts escape often (a newline, a quote every few dozen bytes), and a branch per
 * escape costs a misprediction each. So the string is read 64 bytes at a time as bit
 * masks: the escaped bytes are found by walking the backslashes (one step per escape,
 * no branch on the bytes between), the string's end is the first quote not escaped, and
 * the chunk is refused at once if a control byte lies before it. Only the escaped bytes
 * themselves are looked at one by one, to check that each is one the grammar has.
 */
#if defined(VR_STRING_NOINLINE)
static const unsigned char *VR_STRING(const unsigned char *p, const unsigned char *e)
#else
static inline const unsigned char *VR_STRING(const unsigned char *p, const unsigned char *e)
#endif
{
    p++;
    {
        const unsigned char *skip = p; /* bytes before it were read by a \u escape */
        uint64_t carry = 0;            /* the chunk's first byte is escaped */
        uint32_t cp;
        while (e - p >= 64) {
            uint64_t quote, bslash, ctl, esc = carry, bs, quotes, before, ev;
            int i;
            VR_MASKS64(p, &quote, &bslash, &ctl);
            bs = bslash & ~carry; /* an escaped backslash starts nothing */
            carry = 0;
            while (bs) {
                i = __builtin_ctzll(bs);
                if (i == 63) {
                    carry = 1;
                    break;
                }
                esc |= 1ULL << (i + 1);
                bs &= ~(3ULL << i); /* this backslash and the byte it escapes */
            }
            quotes = quote & ~esc;
            before = quotes ? (quotes & (0 - quotes)) - 1 : ~0ULL;
            if (ctl & before)
                return NULL;
            ev = esc & before;
            while (ev) {
                const unsigned char *x = p + __builtin_ctzll(ev);
                ev &= ev - 1;
                if (x < skip)
                    continue;
                if (*x == 'u') {
                    const unsigned char *q = x - 1;
                    if (vb_escape(&q, e, &cp) < 0)
                        return NULL;
                    skip = q;
                } else if (!vr_escape1[*x]) {
                    return NULL;
                }
            }
            if (quotes)
                return p + __builtin_ctzll(quotes) + 1;
            p += 64;
        }
        if (skip > p)
            p = skip;
        else if (carry) { /* the last chunk ended in a backslash: its escape first */
            const unsigned char *q = p - 1;
            if (vb_escape(&q, e, &cp) < 0)
                return NULL;
            p = q;
        }
    }
    return vr_string_tail(p, e);
}
