/* The state the gateway's worker processes share: one memory segment, mapped by
 * each worker (state/shm.pyx), updated with atomic operations only (no lock).
 *
 * Slots are claimed by name (an endpoint, a pool's model, a tenant) and never freed
 * while the segment lives; each worker's share of a count is kept beside the total,
 * so that the supervisor can give back what a dead worker held (vf_reclaim).
 *
 * Buckets are GCRA cells: one 64-bit time, so that a draw is one compare-and-swap.
 * The level at `now` is min(cap, (now - t) * rate); drawing `a` moves t by a / rate.
 */
#ifndef VF_SHARED_STATE_H
#define VF_SHARED_STATE_H

#include <stdint.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>

#define VF_SHM_MAGIC 0x3256454c4f434954ULL /* "TICOLEV2", a version in the last byte */
#define VF_MAX_WORKERS 64
#define VF_MAX_BANDS 8
#define VF_EP_SLOTS 256
#define VF_POOL_SLOTS 64
#define VF_TENANT_SLOTS 1024
#define VF_NAME 64

typedef struct {
    int64_t state;          /* 0 free, 1 being claimed, 2 named */
    char name[VF_NAME];
} vf_key;

typedef struct {
    vf_key key;
    int64_t inflight;                     /* every worker's requests on the engine */
    int64_t mine[VF_MAX_WORKERS];         /* each worker's part of it */
    int64_t limit_w[VF_MAX_WORKERS];      /* each worker's concurrency limit (0: none said) */
    int64_t cap_bits;                     /* the learned batch (a double's bits; 0: unknown) */
    int64_t overcommits;                  /* binds that found the engine full (limits shrank) */
} vf_ep;

typedef struct {
    vf_key key;
    int64_t committed;                    /* reservations: grants, bound or not, of every worker */
    int64_t refused;                      /* reservations refused: the pool was full across the workers */
    int64_t mine[VF_MAX_WORKERS];
    int64_t queued[VF_MAX_WORKERS][VF_MAX_BANDS];  /* each worker's queue depth per band */
    int64_t oldest[VF_MAX_WORKERS][VF_MAX_BANDS];  /* when its oldest queued item came (a double's bits; 0: none) */
} vf_pool;

typedef struct {
    double rate;                          /* units a second */
    double cap;                           /* the bucket's size */
    int64_t t;                            /* ns: the level is min(cap, (now - t) * rate) */
} vf_cell;

typedef struct {
    vf_key key;
    vf_cell req;                          /* requests_per_second, burst */
    vf_cell tok;                          /* tokens_per_minute */
    int64_t vtc[VF_MAX_BANDS];            /* per band, the fairness counter (a double's bits) */
    int64_t pend[VF_MAX_BANDS];           /* per band, what of it is charged to answers not ended (bits) */
    int64_t lift[VF_MAX_BANDS];           /* per band, what lifts added to it (bits) */
} vf_tenant;

typedef struct {
    uint64_t magic;
    int64_t workers;
    int64_t restarts;
    int64_t lost;
    vf_ep eps[VF_EP_SLOTS];
    vf_pool pools[VF_POOL_SLOTS];
    vf_tenant tenants[VF_TENANT_SLOTS];
} vf_shm;

#define VF_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define VF_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define VF_ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)
#define VF_XCHG(p, v) __atomic_exchange_n((p), (v), __ATOMIC_ACQ_REL)
#define VF_CAS(p, expp, v) __atomic_compare_exchange_n((p), (expp), (v), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)

static inline int64_t vf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- the segment ------------------------------------------------------------------ */

/* Map the segment at `path` (made, sized and zeroed when `create`); NULL on failure. */
static inline vf_shm *vf_map(const char *path, int create, int64_t workers) {
    int fd = open(path, create ? (O_RDWR | O_CREAT | O_TRUNC) : O_RDWR, 0600);
    void *p;
    vf_shm *s;
    if (fd < 0)
        return NULL;
    if (create && ftruncate(fd, (off_t)sizeof(vf_shm)) != 0) {
        close(fd);
        return NULL;
    }
    p = mmap(NULL, sizeof(vf_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return NULL;
    s = (vf_shm *)p;
    if (create) {
        s->workers = workers;
        VF_STORE(&s->magic, VF_SHM_MAGIC);
    } else if (VF_LOAD(&s->magic) != VF_SHM_MAGIC) {
        munmap(p, sizeof(vf_shm));
        return NULL;
    }
    return s;
}

static inline void vf_unmap(vf_shm *s) {
    if (s)
        munmap((void *)s, sizeof(vf_shm));
}

/* The slot named `name` (len < VF_NAME) among `n` keys `stride` bytes apart: found, or
 * claimed; -1 when the table is full. Two workers claiming one name meet on its state. */
static inline int64_t vf_slot(char *base, size_t stride, int64_t n, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL;
    size_t i;
    int64_t k, probe, zero, spin;
    vf_key *key;
    for (i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    for (probe = 0; probe < n; probe++) {
        k = (int64_t)((h + (uint64_t)probe) % (uint64_t)n);
        key = (vf_key *)(base + (size_t)k * stride);
        zero = 0;
        if (VF_LOAD(&key->state) == 0 && VF_CAS(&key->state, &zero, 1)) {
            memset(key->name, 0, VF_NAME);
            memcpy(key->name, name, len);
            VF_STORE(&key->state, 2);
            return k;
        }
        for (spin = 0; VF_LOAD(&key->state) == 1 && spin < 100000000; spin++)
            ;  /* another worker is writing this slot's name: a few stores away */
        if (strncmp(key->name, name, VF_NAME) == 0 && key->name[len] == 0)
            return k;
    }
    return -1;
}

/* -- endpoints ---------------------------------------------------------------------- */

/* One more (or fewer) of worker w's requests on the engine: the new total. */
static inline int64_t vf_ep_add(vf_ep *e, int w, int64_t d) {
    VF_ADD(&e->mine[w], d);
    return VF_ADD(&e->inflight, d);
}

/* One more of worker w's requests if the total stays within `limit`: the new total,
 * else -1 (full). */
static inline int64_t vf_ep_claim(vf_ep *e, int w, int64_t limit) {
    int64_t cur = VF_LOAD(&e->inflight);
    while (cur < limit) {
        if (VF_CAS(&e->inflight, &cur, cur + 1)) {
            VF_ADD(&e->mine[w], 1);
            return cur + 1;
        }
    }
    return -1;
}

/* The smallest limit a live worker set (0: none set). */
static inline int64_t vf_ep_limit(vf_ep *e, int64_t workers) {
    int64_t i, v, best = 0;
    for (i = 0; i < workers && i < VF_MAX_WORKERS; i++) {
        v = VF_LOAD(&e->limit_w[i]);
        if (v > 0 && (best == 0 || v < best))
            best = v;
    }
    return best;
}

static inline double vf_ep_cap(vf_ep *e) {
    int64_t bits = VF_LOAD(&e->cap_bits);
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The learned batch: the largest any worker learned. */
static inline void vf_ep_learn_cap(vf_ep *e, double cap) {
    int64_t bits, cur = VF_LOAD(&e->cap_bits);
    memcpy(&bits, &cap, sizeof bits);
    while (vf_ep_cap(e) < cap) {
        if (VF_CAS(&e->cap_bits, &cur, bits))
            return;
    }
}

/* -- pools -------------------------------------------------------------------------- */

/* One more reservation for worker w if the pool's stay within `capacity`: 1, else 0
 * (counted in `refused`). */
static inline int vf_pool_reserve(vf_pool *p, int w, int64_t capacity) {
    int64_t cur = VF_LOAD(&p->committed);
    while (cur < capacity) {
        if (VF_CAS(&p->committed, &cur, cur + 1)) {
            VF_ADD(&p->mine[w], 1);
            return 1;
        }
    }
    VF_ADD(&p->refused, 1);
    return 0;
}

static inline void vf_pool_release(vf_pool *p, int w) {
    VF_ADD(&p->mine[w], -1);
    VF_ADD(&p->committed, -1);
}

/* Items the other workers hold queued in bands 0..band. */
static inline int64_t vf_pool_queued_others(vf_pool *p, int w, int64_t workers, int band) {
    int64_t i, n = 0;
    int b;
    for (i = 0; i < workers && i < VF_MAX_WORKERS; i++) {
        if (i == w)
            continue;
        for (b = 0; b <= band && b < VF_MAX_BANDS; b++)
            n += VF_LOAD(&p->queued[i][b]);
    }
    return n;
}

/* -- counters held as doubles ------------------------------------------------------ */

static inline double vf_dbl_load(int64_t *p) {
    int64_t bits = VF_LOAD(p);
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Add d to the double at p: the new value. */
static inline double vf_dbl_add(int64_t *p, double d) {
    int64_t cur = VF_LOAD(p), nbits;
    double v;
    for (;;) {
        memcpy(&v, &cur, sizeof v);
        v += d;
        memcpy(&nbits, &v, sizeof nbits);
        if (VF_CAS(p, &cur, nbits))
            return v;
    }
}

/* Raise the double at p to at least v: the value it holds then. */
static inline double vf_dbl_raise(int64_t *p, double v) {
    int64_t cur = VF_LOAD(p), nbits;
    double have;
    memcpy(&nbits, &v, sizeof nbits);
    for (;;) {
        memcpy(&have, &cur, sizeof have);
        if (have >= v)
            return have;
        if (VF_CAS(p, &cur, nbits))
            return v;
    }
}

static inline int64_t *vf_tenant_pend(vf_tenant *t, int band) {
    return &t->pend[band < VF_MAX_BANDS ? band : VF_MAX_BANDS - 1];
}

static inline int64_t *vf_tenant_lift(vf_tenant *t, int band) {
    return &t->lift[band < VF_MAX_BANDS ? band : VF_MAX_BANDS - 1];
}

static inline int64_t *vf_tenant_vtc(vf_tenant *t, int band) {
    return &t->vtc[band < VF_MAX_BANDS ? band : VF_MAX_BANDS - 1];
}

/* Another worker holds an item queued in `band` that came before `at` (seconds, the
 * monotonic clock every process shares): the slot is its to take. */
static inline int vf_pool_older_elsewhere(vf_pool *p, int w, int64_t workers, int band, double at) {
    int64_t i, bits;
    double v;
    if (band < 0 || band >= VF_MAX_BANDS)
        return 0;
    for (i = 0; i < workers && i < VF_MAX_WORKERS; i++) {
        if (i == w)
            continue;
        bits = VF_LOAD(&p->oldest[i][band]);
        if (bits == 0)
            continue;
        memcpy(&v, &bits, sizeof v);
        if (v < at)
            return 1;
    }
    return 0;
}

static inline void vf_pool_publish_oldest(vf_pool *p, int w, int band, double at) {
    int64_t bits = 0;
    if (at > 0.0)
        memcpy(&bits, &at, sizeof bits);
    if (band < VF_MAX_BANDS)
        VF_STORE(&p->oldest[w][band], bits);
}

/* -- buckets ------------------------------------------------------------------------ */

/* Set the cell's rate and size; a cell whose limits change (or a new one) starts full. */
static inline void vf_cell_config(vf_cell *c, double rate, double cap) {
    if (c->rate != rate || c->cap != cap || c->t == 0) {
        c->rate = rate;
        c->cap = cap;
        double full_ns = cap / rate * 1e9;  /* how long the bucket takes to fill */
        if (full_ns > 4e18)
            full_ns = 4e18;  /* (a rate so low the cell would overflow: full enough) */
        VF_STORE(&c->t, vf_now_ns() - (int64_t)full_ns - 1);
    }
}

static inline double vf_cell_level(vf_cell *c, int64_t now, int64_t t) {
    double lvl = (double)(now - t) / 1e9 * c->rate;
    return lvl < c->cap ? lvl : c->cap;
}

/* Draw `amount` if `need` are there: 0.0, else the seconds until they would be. */
static inline double vf_cell_draw(vf_cell *c, double amount, double need) {
    int64_t now = vf_now_ns(), t = VF_LOAD(&c->t), nt;
    double lvl;
    for (;;) {
        lvl = vf_cell_level(c, now, t);
        if (lvl < need)
            return (need - lvl) / c->rate;
        nt = now - (int64_t)((lvl - amount) / c->rate * 1e9);
        if (VF_CAS(&c->t, &t, nt))
            return 0.0;
    }
}

/* The answer used `delta` more than was drawn (less when negative): the level may go
 * below zero, a debt that later draws wait out. */
static inline void vf_cell_settle(vf_cell *c, double delta) {
    int64_t now = vf_now_ns(), t = VF_LOAD(&c->t), nt;
    double lvl;
    for (;;) {
        lvl = vf_cell_level(c, now, t);
        nt = now - (int64_t)((lvl - delta) / c->rate * 1e9);
        if (VF_CAS(&c->t, &t, nt))
            return;
    }
}

static inline double vf_cell_left(vf_cell *c) {
    return vf_cell_level(c, vf_now_ns(), VF_LOAD(&c->t));
}

/* -- field addresses, for the code that maps the segment ---------------------------- */

static inline vf_ep *vf_eps(vf_shm *s) { return s->eps; }
static inline vf_pool *vf_pools(vf_shm *s) { return s->pools; }
static inline vf_tenant *vf_tenants(vf_shm *s) { return s->tenants; }
static inline int64_t *vf_restarts(vf_shm *s) { return &s->restarts; }
static inline int64_t *vf_lost(vf_shm *s) { return &s->lost; }
static inline int64_t *vf_mine_at(vf_ep *e, int w) { return &e->mine[w]; }
static inline int64_t *vf_limit_at(vf_ep *e, int w) { return &e->limit_w[w]; }
static inline int64_t *vf_queued_at(vf_pool *p, int w, int b) { return &p->queued[w][b]; }
static inline int vf_key_named(void *slot) { return VF_LOAD(&((vf_key *)slot)->state) == 2; }
static inline const char *vf_key_name(void *slot) { return ((vf_key *)slot)->name; }

/* -- a worker's end ------------------------------------------------------------------ */

/* Give back what worker w held: its requests in flight (returned) and its reservations,
 * queues and limits. Called by the supervisor once the worker has exited. */
static inline int64_t vf_reclaim(vf_shm *s, int w, int64_t *reserved) {
    int64_t i, x, lost = 0, held = 0;
    int b;
    for (i = 0; i < VF_EP_SLOTS; i++) {
        vf_ep *e = &s->eps[i];
        if (VF_LOAD(&e->key.state) != 2)
            continue;
        x = VF_XCHG(&e->mine[w], 0);
        if (x)
            VF_ADD(&e->inflight, -x);
        lost += x;
        VF_STORE(&e->limit_w[w], 0);
    }
    for (i = 0; i < VF_POOL_SLOTS; i++) {
        vf_pool *p = &s->pools[i];
        if (VF_LOAD(&p->key.state) != 2)
            continue;
        x = VF_XCHG(&p->mine[w], 0);
        if (x)
            VF_ADD(&p->committed, -x);
        held += x;
        for (b = 0; b < VF_MAX_BANDS; b++) {
            VF_STORE(&p->queued[w][b], 0);
            VF_STORE(&p->oldest[w][b], 0);
        }
    }
    if (reserved)
        *reserved = held;
    return lost;
}

#endif
