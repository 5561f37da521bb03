/* Tuning constants and codes of the admission core (bands, saturation, aimd).
 *
 * One home for every number the compiled admission code uses, so a reader tunes
 * them in one place; the .pyx files declare them through `cdef extern`.
 */
#ifndef VF_ADMISSION_CONSTS_H
#define VF_ADMISSION_CONSTS_H

/* BandQueues.enqueue returns a positive id, or one of these (negative so the two
 * never collide). */
#define VF_REJECT_BAND_COUNT   (-1)
#define VF_REJECT_BAND_BYTES   (-2)
#define VF_REJECT_GLOBAL_COUNT (-3)
#define VF_REJECT_GLOBAL_BYTES (-4)
#define VF_REJECT_BAD_BAND     (-5)

/* Token-weighted fairness charges prompt bytes at about 4 bytes a token: no
 * tokenizer runs on the admission path. */
#define VF_BYTES_PER_TOKEN 4.0

/* Saturation defaults (DESIGN section 4): 5 waiting requests or 80 % KV cache
 * is "saturated" (1.0). */
#define VF_QUEUE_THRESHOLD 5.0
#define VF_KV_THRESHOLD    0.8
/* A scrape older than this is stale: fall back to the gateway's own counts.
 * Ten default scrape intervals (100 ms) leaves room for a slow engine. */
#define VF_STALE_AFTER_S   1.0

/* AIMD: additive step and multiplicative factor of DESIGN section 4. */
#define VF_AIMD_INCREASE   1.0
#define VF_AIMD_DECREASE   0.75
/* Default OOM cool-down: increases frozen and non-high work shed this long. */
#define VF_AIMD_COOLDOWN_S 10.0

#endif
