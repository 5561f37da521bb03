/* Tuning constants and codes of the admission core (bands, saturation, aimd, the
 * dispatch cycle, its SLA model and its pace).
 *
 * One home for every number the compiled admission code uses, so a reader tunes
 * them in one place; the .pxd files declare them through `cdef extern`, and each
 * module names its own for Python from there (NAME = VF_NAME).
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
/* The KV an engine's cache will hold once this gateway's requests there have decoded
 * what they may (its usage now plus their max_tokens left, at the engine's pace) is
 * "saturated" at this share: a band of ceiling c admits while that is below 0.95 c. */
#define VF_KV_PROJECTED    0.95
/* An engine whose cache, as it will be, is past this share of that (the low band's
 * soft ceiling) is held by its KV, not by a count: its probe is over (_in_turn). */
#define VF_KV_HELD         0.7
/* A scrape older than this is stale: fall back to the gateway's own counts.
 * Ten default scrape intervals (100 ms) leaves room for a slow engine. */
#define VF_STALE_AFTER_S   1.0

/* AIMD: additive step and multiplicative factor of DESIGN section 4. */
#define VF_AIMD_INCREASE   1.0
#define VF_AIMD_DECREASE   0.75
/* Default OOM cool-down: increases frozen and non-high work shed this long. */
#define VF_AIMD_COOLDOWN_S 10.0

/* An engine slower than this many times its usual service time, on a request that
 * missed its SLA, counts as congested (AIMD cuts its limit). */
#define VF_CONGESTION_FACTOR 1.5
/* An engine with nothing in flight or running for this long gets its starting limit
 * back (aimd.pyx, on_idle): the pace needs noted before are forgotten by then too. */
#define VF_IDLE_RESET_S 10.0

/* Pace: the share of a deadline's time (past the expected first token) that decoding
 * may take; the share of that pace at which an engine's limit stops growing (HOLD) and
 * is cut (CUT). A window of grants (seconds) keeps a need; it is forgotten two windows
 * after the last such grant. */
#define VF_PACE_MARGIN   0.9
#define VF_PACE_HOLD     1.1
#define VF_PACE_CUT      1.3
#define VF_PACE_WINDOW_S 5.0
/* A need that only an engine within this share of its solo pace meets (one or two
 * sequences: by the tenth of HOLD's slack, at most 1.25 x solo) holds no limit: holding
 * a whole engine near one sequence for one request's deadline costs every other
 * request its throughput, and a clients' mix of replies the engine ends (no max_tokens)
 * keeps such needs coming. */
#define VF_PACE_ROOM     1.25

/* A Retry-After aims at a completion this share of the SLA before the deadline: the
 * queue model is an average, and a promise made at the edge is broken half the time. */
#define VF_RETRY_MARGIN 0.1
/* The furthest a Retry-After looks ahead: under a sustained overload the times told
 * would grow without end (and the OpenAI clients give up on one past two minutes); past
 * this the time told is this, and it is not booked ahead of the next. */
#define VF_RETRY_MAX_S 60.0

#endif
