/*
 * The prefix index: which endpoint was recently sent which block hashes.
 *
 * Up to 64 endpoints ("slots") share one index. Two open-addressing tables (linear
 * probing, power-of-two sizes, deletion by backward shift so there are no tombstones):
 *   entries: block hash -> 64-bit mask of the slots holding it. Matching a prompt is
 *            one lookup per block for all endpoints at once: the set of endpoints still
 *            matching is ANDed with each block's mask, and an endpoint's matched length
 *            is the block at which it drops out.
 *   refs:    (block hash, slot) -> node, to find the LRU node of a pair in O(1).
 * Nodes live in one array (indices stay valid when it grows) and are linked into
 * their slot's LRU list, most recent at the head; each slot has its own capacity.
 * Insert, touch and evict are O(1) expected.
 *
 * Memory grows with what is stored (tables kept at most half full) and is kept at
 * its high-water mark afterwards; a full index of N pairs uses about 24 + 32 + 32 bytes
 * per pair in the worst case (every hash held by one endpoint only).
 */
#ifndef VELOCITY_PREFIX_INDEX_H
#define VELOCITY_PREFIX_INDEX_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefix_hash.h"

#define VP_MAX_SLOTS 64
#define VP_NIL 0xFFFFFFFFu
/* Node indices are 32-bit; refs store index + 1 so that 0 marks an empty bucket. */
#define VP_MAX_NODES 0xFFFFFFF0u
#define VP_MIN_TABLE 64
/* Blocks looked up ahead of use while matching, to hide memory latency. */
#define VP_PREFETCH 8

/* The entry points routing/prefix.pxd declares. Every module that cimports that .pxd
 * includes this header, and only prefix.pyx calls them: unused elsewhere by design, which
 * the attribute tells the compiler (it changes no generated code, unlike `inline`). */
#if defined(__GNUC__)
#define VP_API static __attribute__((unused))
#else
#define VP_API static
#endif

typedef struct {
    uint64_t key;
    uint64_t mask; /* 0: empty bucket */
} vp_entry;

typedef struct {
    uint64_t key;
    uint32_t prev, next; /* toward head / toward tail; next doubles as the free-list link */
    uint32_t slot;
    uint32_t weight; /* the blocks this key stands for (a key past a chain's fine head: many) */
} vp_node;

/* The key and slot are kept inline so that probing and backward shifts never touch the
 * node array (each node access would be one more cache miss). */
typedef struct {
    uint64_t key;
    uint32_t node; /* node index + 1; 0: empty bucket */
    uint32_t slot;
} vp_ref;

typedef struct {
    uint32_t head, tail;
    uint64_t count, capacity; /* in blocks: the sum of the keys' weights */
    uint64_t keys;            /* keys held */
} vp_lru;

typedef struct {
    vp_entry *ents;
    uint64_t ents_mask, ents_used;
    vp_ref *refs;
    uint64_t refs_mask;
    vp_node *nodes;
    uint64_t nodes_cap, nodes_top; /* allocated, ever used */
    uint32_t free_head;
    uint32_t max_weight; /* the heaviest key ever stored: what one eviction may free at most */
    uint64_t live; /* nodes in use = pairs stored */
    vp_lru lru[VP_MAX_SLOTS];
} vp_index;

static inline uint64_t vp_ref_home(uint64_t key, uint32_t slot, uint64_t mask)
{
    return (key + (uint64_t)(slot + 1) * VP_K0) & mask;
}

VP_API int vp_index_init(vp_index *ix)
{
    int s;
    memset(ix, 0, sizeof *ix);
    ix->ents = (vp_entry *)calloc(VP_MIN_TABLE, sizeof(vp_entry));
    ix->refs = (vp_ref *)calloc(VP_MIN_TABLE, sizeof(vp_ref));
    if (!ix->ents || !ix->refs) {
        free(ix->ents);
        free(ix->refs);
        ix->ents = NULL;
        ix->refs = NULL;
        return -1;
    }
    ix->ents_mask = VP_MIN_TABLE - 1;
    ix->refs_mask = VP_MIN_TABLE - 1;
    ix->free_head = VP_NIL;
    for (s = 0; s < VP_MAX_SLOTS; s++) {
        ix->lru[s].head = VP_NIL;
        ix->lru[s].tail = VP_NIL;
    }
    return 0;
}

VP_API void vp_index_free(vp_index *ix)
{
    free(ix->ents);
    free(ix->refs);
    free(ix->nodes);
    ix->ents = NULL;
    ix->refs = NULL;
    ix->nodes = NULL;
}

/* ---- entries: hash -> slot mask ---------------------------------------------- */

static inline uint64_t vp_entry_mask(const vp_index *ix, uint64_t key)
{
    uint64_t i = key & ix->ents_mask;
    for (;;) {
        const vp_entry *e = &ix->ents[i];
        if (e->mask == 0)
            return 0;
        if (e->key == key)
            return e->mask;
        i = (i + 1) & ix->ents_mask;
    }
}

static int vp_entries_grow(vp_index *ix)
{
    uint64_t size = (ix->ents_mask + 1) * 2, mask = size - 1, i, j;
    vp_entry *old = ix->ents, *neu = (vp_entry *)calloc(size, sizeof(vp_entry));
    if (!neu)
        return -1;
    for (i = 0; i <= ix->ents_mask; i++) {
        if (old[i].mask == 0)
            continue;
        j = old[i].key & mask;
        while (neu[j].mask != 0)
            j = (j + 1) & mask;
        neu[j] = old[i];
    }
    free(old);
    ix->ents = neu;
    ix->ents_mask = mask;
    return 0;
}

static int vp_entry_set(vp_index *ix, uint64_t key, uint32_t slot)
{
    uint64_t i;
    if ((ix->ents_used + 1) * 2 > ix->ents_mask + 1 && vp_entries_grow(ix) < 0)
        return -1;
    i = key & ix->ents_mask;
    for (;;) {
        vp_entry *e = &ix->ents[i];
        if (e->mask == 0) {
            e->key = key;
            e->mask = 1ULL << slot;
            ix->ents_used++;
            return 0;
        }
        if (e->key == key) {
            e->mask |= 1ULL << slot;
            return 0;
        }
        i = (i + 1) & ix->ents_mask;
    }
}

static void vp_entry_clear(vp_index *ix, uint64_t key, uint32_t slot)
{
    uint64_t m = ix->ents_mask, i = key & m, j, home;
    for (;;) {
        vp_entry *e = &ix->ents[i];
        if (e->mask == 0)
            return;
        if (e->key == key)
            break;
        i = (i + 1) & m;
    }
    ix->ents[i].mask &= ~(1ULL << slot);
    if (ix->ents[i].mask != 0)
        return;
    /* Backward shift: pull later members of the probe run into the hole. */
    ix->ents_used--;
    j = i;
    for (;;) {
        j = (j + 1) & m;
        if (ix->ents[j].mask == 0)
            break;
        home = ix->ents[j].key & m;
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j))
            continue; /* its home lies between the hole and it: it may not move */
        ix->ents[i] = ix->ents[j];
        i = j;
    }
    ix->ents[i].mask = 0;
}

/* ---- refs: (hash, slot) -> node ----------------------------------------------- */

static inline uint32_t vp_ref_find(const vp_index *ix, uint64_t key, uint32_t slot)
{
    uint64_t i = vp_ref_home(key, slot, ix->refs_mask);
    for (;;) {
        const vp_ref *r = &ix->refs[i];
        if (r->node == 0)
            return VP_NIL;
        if (r->key == key && r->slot == slot)
            return r->node - 1;
        i = (i + 1) & ix->refs_mask;
    }
}

static int vp_refs_grow(vp_index *ix)
{
    uint64_t size = (ix->refs_mask + 1) * 2, mask = size - 1, i, j;
    vp_ref *old = ix->refs, *neu = (vp_ref *)calloc(size, sizeof(vp_ref));
    if (!neu)
        return -1;
    for (i = 0; i <= ix->refs_mask; i++) {
        if (old[i].node == 0)
            continue;
        j = vp_ref_home(old[i].key, old[i].slot, mask);
        while (neu[j].node != 0)
            j = (j + 1) & mask;
        neu[j] = old[i];
    }
    free(old);
    ix->refs = neu;
    ix->refs_mask = mask;
    return 0;
}

static void vp_ref_insert(vp_index *ix, uint64_t key, uint32_t slot, uint32_t node)
{
    uint64_t i = vp_ref_home(key, slot, ix->refs_mask);
    while (ix->refs[i].node != 0)
        i = (i + 1) & ix->refs_mask;
    ix->refs[i].key = key;
    ix->refs[i].slot = slot;
    ix->refs[i].node = node + 1;
}

static void vp_ref_delete(vp_index *ix, uint64_t key, uint32_t slot)
{
    uint64_t m = ix->refs_mask, i, j, home;
    i = vp_ref_home(key, slot, m);
    for (;;) {
        const vp_ref *r = &ix->refs[i];
        if (r->node == 0)
            return;
        if (r->key == key && r->slot == slot)
            break;
        i = (i + 1) & m;
    }
    j = i;
    for (;;) {
        j = (j + 1) & m;
        if (ix->refs[j].node == 0)
            break;
        home = vp_ref_home(ix->refs[j].key, ix->refs[j].slot, m);
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j))
            continue;
        ix->refs[i] = ix->refs[j];
        i = j;
    }
    ix->refs[i].node = 0;
}

/* ---- LRU lists ------------------------------------------------------------------ */

static inline void vp_lru_unlink(vp_index *ix, uint32_t n)
{
    vp_node *x = &ix->nodes[n];
    vp_lru *l = &ix->lru[x->slot];
    if (x->prev != VP_NIL)
        ix->nodes[x->prev].next = x->next;
    else
        l->head = x->next;
    if (x->next != VP_NIL)
        ix->nodes[x->next].prev = x->prev;
    else
        l->tail = x->prev;
}

static inline void vp_lru_push_head(vp_index *ix, uint32_t n)
{
    vp_node *x = &ix->nodes[n];
    vp_lru *l = &ix->lru[x->slot];
    x->prev = VP_NIL;
    x->next = l->head;
    if (l->head != VP_NIL)
        ix->nodes[l->head].prev = n;
    else
        l->tail = n;
    l->head = n;
}

/* Link n into its slot's list right behind `after` (the head when VP_NIL). */
static inline void vp_lru_link_after(vp_index *ix, uint32_t n, uint32_t after)
{
    vp_node *x, *a;
    vp_lru *l;
    if (after == VP_NIL) {
        vp_lru_push_head(ix, n);
        return;
    }
    x = &ix->nodes[n];
    a = &ix->nodes[after];
    l = &ix->lru[x->slot];
    x->prev = after;
    x->next = a->next;
    if (a->next != VP_NIL)
        ix->nodes[a->next].prev = n;
    else
        l->tail = n;
    a->next = n;
}

static void vp_evict_tail(vp_index *ix, uint32_t slot)
{
    vp_lru *l = &ix->lru[slot];
    uint32_t n = l->tail;
    if (n == VP_NIL)
        return;
    /* Evictions come in runs while a new prompt goes in: start the misses of the next
     * victims now (the node after next, and the next one's table buckets) so that they
     * overlap this eviction instead of following it. */
    if (ix->nodes[n].prev != VP_NIL) {
        const vp_node *next = &ix->nodes[ix->nodes[n].prev];
        __builtin_prefetch(&ix->refs[vp_ref_home(next->key, slot, ix->refs_mask)]);
        __builtin_prefetch(&ix->ents[next->key & ix->ents_mask]);
        if (next->prev != VP_NIL)
            __builtin_prefetch(&ix->nodes[next->prev]);
    }
    vp_lru_unlink(ix, n);
    vp_ref_delete(ix, ix->nodes[n].key, slot);
    vp_entry_clear(ix, ix->nodes[n].key, slot);
    ix->nodes[n].next = ix->free_head;
    ix->free_head = n;
    l->count -= ix->nodes[n].weight;
    l->keys--;
    ix->live--;
}

static uint32_t vp_node_alloc(vp_index *ix)
{
    uint32_t n;
    if (ix->free_head != VP_NIL) {
        n = ix->free_head;
        ix->free_head = ix->nodes[n].next;
        return n;
    }
    if (ix->nodes_top == ix->nodes_cap) {
        uint64_t cap = ix->nodes_cap ? ix->nodes_cap * 2 : 1024;
        vp_node *grown;
        if (cap > VP_MAX_NODES)
            cap = VP_MAX_NODES;
        if (cap <= ix->nodes_cap)
            return VP_NIL;
        grown = (vp_node *)realloc(ix->nodes, cap * sizeof(vp_node));
        if (!grown)
            return VP_NIL;
        ix->nodes = grown;
        ix->nodes_cap = cap;
    }
    return (uint32_t)ix->nodes_top++;
}

/*
 * Mark key as recently sent to slot: move it to the head of the slot's LRU, or insert
 * it there with its weight (the blocks it stands for), evicting the slot's least
 * recently used pairs while the weights would pass the capacity. A key heavier than the
 * whole capacity is not kept. Returns 0, or -1 when memory ran out (the index is left
 * consistent).
 */
static inline __attribute__((always_inline)) int vp_touch(vp_index *ix, uint32_t slot, uint64_t key,
                                                          uint32_t weight, uint32_t after)
{
    vp_lru *l = &ix->lru[slot];
    uint32_t n;
    if (l->capacity < weight || weight == 0)
        return 0;
    n = vp_ref_find(ix, key, slot);
    if (n != VP_NIL) {
        if (n == after)
            return 0; /* a key twice in one chain (only where hashes collide) */
        if (after == VP_NIL ? l->head != n : ix->nodes[n].prev != after) {
            vp_lru_unlink(ix, n);
            vp_lru_link_after(ix, n, after);
        }
        return 0;
    }
    while (l->count + weight > l->capacity && l->tail != VP_NIL)
        vp_evict_tail(ix, slot);
    if ((ix->live + 1) * 2 > ix->refs_mask + 1 && vp_refs_grow(ix) < 0)
        return -1;
    if (vp_entry_set(ix, key, slot) < 0)
        return -1;
    n = vp_node_alloc(ix);
    if (n == VP_NIL) {
        vp_entry_clear(ix, key, slot);
        return -1;
    }
    ix->nodes[n].key = key;
    ix->nodes[n].slot = slot;
    ix->nodes[n].weight = weight;
    if (weight > ix->max_weight)
        ix->max_weight = weight;
    vp_lru_link_after(ix, n, after);
    vp_ref_insert(ix, key, slot, n);
    l->count += weight;
    l->keys++;
    ix->live++;
    return 0;
}

/* How many of the chain's leading keys head the slot's list, in the chain's order (the
 * same prompt sent here again, or one that shares its head with the last one sent here:
 * a system prompt, a conversation's earlier turns). */
VP_API size_t vp_head_run(const vp_index *ix, uint32_t slot, const uint64_t *keys, size_t n)
{
    uint32_t x = ix->lru[slot].head;
    size_t run = 0;
    while (run < n && x != VP_NIL && ix->nodes[x].key == keys[run]) {
        x = ix->nodes[x].next;
        run++;
    }
    return run;
}

/* Touch a prompt's chain, last block first, so that its leading blocks end up the most
 * recent and are evicted last (a longer prefix is useless once its head is gone;
 * vLLM frees a sequence's blocks tail first for the same reason). The first `fine` keys
 * weigh one block each, the others `coarse` blocks (a long prompt's thinned tail), the
 * last `tail` blocks when not 0 (the blocks after the last whole coarse step).
 *
 * `run`: the chain's leading keys that head the slot's list already (vp_head_run). They
 * stay where they are, and the rest go in right behind them: the order that touching
 * each, last first, gives, without a lookup and a move for each of those keys. Only
 * while the evictions the rest may cause cannot reach them: the blocks behind them are
 * more than the rest weigh plus the heaviest key (an eviction frees at most that past
 * what is needed), so the same pairs are evicted, in the same order; otherwise each key
 * is touched. Returns 0, or -1 when memory ran out. */
VP_API int vp_touch_chain(vp_index *ix, uint32_t slot, const uint64_t *keys, size_t n,
                          size_t fine, uint32_t coarse, uint32_t tail, size_t run)
{
    vp_lru *l = &ix->lru[slot];
    size_t i;
    uint32_t x = l->head, after = VP_NIL, w;
    uint64_t held = 0, rest = 0;
    if (run >= n)
        return 0;
    for (i = 0; i < run; i++) {
        held += ix->nodes[x].weight;
        after = x;
        x = ix->nodes[x].next;
    }
    if (run > 0) {
        for (i = run; i < n; i++) {
            w = i < fine ? 1u : (tail && i == n - 1 ? tail : coarse);
            if (w <= l->capacity)
                rest += w;
        }
        if (l->count - held <= rest + ix->max_weight) {
            after = VP_NIL; /* evictions could reach the head's keys: each is touched */
            run = 0;
        }
    }
    i = n;
    while (i > run) {
        --i;
        /* The keys to come are known: start their cache misses now, so they overlap. */
        if (i >= run + VP_PREFETCH) {
            uint64_t k = keys[i - VP_PREFETCH];
            __builtin_prefetch(&ix->refs[vp_ref_home(k, slot, ix->refs_mask)]);
            __builtin_prefetch(&ix->ents[k & ix->ents_mask]);
        }
        w = i < fine ? 1u : (tail && i == n - 1 ? tail : coarse);
        /* two calls, each inlined: the head's (after == VP_NIL) as plain as before */
        if ((after == VP_NIL ? vp_touch(ix, slot, keys[i], w, VP_NIL) : vp_touch(ix, slot, keys[i], w, after)) < 0)
            return -1;
    }
    return 0;
}

/* How many leading keys of a chain slot already holds (the hit of one dispatch). */
VP_API size_t vp_leading_held(const vp_index *ix, uint32_t slot, const uint64_t *keys, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        if (!((vp_entry_mask(ix, keys[i]) >> slot) & 1))
            break;
    }
    return i;
}

/* A slot's keys from the most to the least recently used, at most cap of them. */
VP_API void vp_lru_keys(const vp_index *ix, uint32_t slot, uint64_t *out, size_t cap)
{
    uint32_t n = ix->lru[slot].head;
    size_t i = 0;
    while (n != VP_NIL && i < cap) {
        out[i++] = ix->nodes[n].key;
        n = ix->nodes[n].next;
    }
}

VP_API void vp_set_capacity(vp_index *ix, uint32_t slot, uint64_t capacity)
{
    vp_lru *l = &ix->lru[slot];
    l->capacity = capacity;
    while (l->count > capacity)
        vp_evict_tail(ix, slot);
}

/*
 * Matched leading blocks of every slot in `alive` in one pass over the chain:
 * out[s] = number of leading keys that slot s holds, for each s in alive (others are
 * left untouched). Stops as soon as no slot matches any more.
 */
VP_API void vp_match(const vp_index *ix, const uint64_t *keys, size_t n, uint64_t alive,
                     uint32_t *out)
{
    size_t i;
    uint64_t dropped;
    for (i = 0; i < n && alive; i++) {
        if (i + VP_PREFETCH < n)
            __builtin_prefetch(&ix->ents[keys[i + VP_PREFETCH] & ix->ents_mask]);
        dropped = alive & ~vp_entry_mask(ix, keys[i]);
        alive &= ~dropped;
        while (dropped) {
            out[__builtin_ctzll(dropped)] = (uint32_t)i;
            dropped &= dropped - 1;
        }
    }
    while (alive) {
        out[__builtin_ctzll(alive)] = (uint32_t)i;
        alive &= alive - 1;
    }
}

#endif /* VELOCITY_PREFIX_INDEX_H */
