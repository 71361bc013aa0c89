/* policy.c - recency list of slots and victim selection.
 *
 * The recency order is an intrusive doubly linked list over slot indices (head =
 * oldest, tail = newest), so touch and forget are O(1) and the oldest slots are
 * walked from the head.
 */
#include "policy.h"

#include <stdlib.h>
#include <string.h>

#define NIL UINT32_MAX

struct sl_policy {
    enum sl_policy_kind kind;
    uint32_t n_slot;
    uint32_t head, tail; /* oldest, newest */
    uint32_t *prev;      /* [n_slot] */
    uint32_t *next;      /* [n_slot] */
    uint32_t *cand;      /* [n_oldest] scratch for the random pick */
    uint8_t *empty;      /* [n_slot] 1 while the slot holds nothing (kept at the head) */
    uint32_t n_oldest;   /* candidates the random policy draws from */
    uint64_t rng;        /* splitmix64 state */
};

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void unlink_slot(sl_policy *p, uint32_t s)
{
    uint32_t a = p->prev[s], b = p->next[s];
    if (a != NIL)
        p->next[a] = b;
    else
        p->head = b;
    if (b != NIL)
        p->prev[b] = a;
    else
        p->tail = a;
    p->prev[s] = p->next[s] = NIL;
}

static void push_newest(sl_policy *p, uint32_t s)
{
    p->prev[s] = p->tail;
    p->next[s] = NIL;
    if (p->tail != NIL)
        p->next[p->tail] = s;
    else
        p->head = s;
    p->tail = s;
}

static void push_oldest(sl_policy *p, uint32_t s)
{
    p->next[s] = p->head;
    p->prev[s] = NIL;
    if (p->head != NIL)
        p->prev[p->head] = s;
    else
        p->tail = s;
    p->head = s;
}

int sl_policy_init(sl_policy **out, enum sl_policy_kind kind, uint32_t n_slot, uint64_t seed,
                   sl_err *err)
{
    *out = NULL;
    if (n_slot == 0 || n_slot == NIL)
        return sl_err_set(err, SL_EINVAL, "eviction policy: %u slots is not a usable count",
                          n_slot);
    if (kind != SL_POLICY_OLDEST_RANDOM && kind != SL_POLICY_LRU)
        return sl_err_set(err, SL_EINVAL, "eviction policy: unknown kind %d", (int)kind);
    sl_policy *p = calloc(1, sizeof *p);
    if (!p) return sl_err_set(err, SL_ENOMEM, "eviction policy: out of memory");
    p->kind = kind;
    p->n_slot = n_slot;
    p->n_oldest = (uint32_t)(((uint64_t)n_slot * SL_POLICY_OLDEST_PERCENT + 99) / 100);
    if (p->n_oldest == 0) p->n_oldest = 1;
    p->rng = seed;
    p->prev = malloc(sizeof(uint32_t) * n_slot);
    p->next = malloc(sizeof(uint32_t) * n_slot);
    p->cand = malloc(sizeof(uint32_t) * p->n_oldest);
    p->empty = malloc(n_slot);
    if (!p->prev || !p->next || !p->cand || !p->empty) {
        sl_policy_free(&p);
        return sl_err_set(err, SL_ENOMEM, "eviction policy: out of memory for %u slots", n_slot);
    }
    p->head = p->tail = NIL;
    for (uint32_t s = 0; s < n_slot; s++) push_newest(p, s);
    memset(p->empty, 1, n_slot);
    *out = p;
    return 0;
}

void sl_policy_free(sl_policy **pp)
{
    if (!pp || !*pp) return;
    sl_policy *p = *pp;
    free(p->prev);
    free(p->next);
    free(p->cand);
    free(p->empty);
    free(p);
    *pp = NULL;
}

void sl_policy_touch(sl_policy *p, uint32_t slot)
{
    SL_ASSERT(slot < p->n_slot);
    p->empty[slot] = 0;
    if (p->tail == slot) return;
    unlink_slot(p, slot);
    push_newest(p, slot);
}

void sl_policy_forget(sl_policy *p, uint32_t slot)
{
    SL_ASSERT(slot < p->n_slot);
    p->empty[slot] = 1;
    if (p->head == slot) return;
    unlink_slot(p, slot);
    push_oldest(p, slot);
}

int64_t sl_policy_victim(sl_policy *p, sl_policy_busy_fn busy, void *ctx)
{
    /* An empty slot costs nothing to reuse: take one before evicting anything. Empty
     * slots sit at the head (init and forget put them there). */
    for (uint32_t s = p->head; s != NIL && p->empty[s]; s = p->next[s])
        if (!busy || !busy(ctx, s)) return s;
    uint32_t want = p->kind == SL_POLICY_LRU ? 1 : p->n_oldest;
    uint32_t n = 0;
    for (uint32_t s = p->head; s != NIL && n < want; s = p->next[s])
        if (!busy || !busy(ctx, s)) p->cand[n++] = s;
    if (n == 0) return -1;
    if (n == 1) return p->cand[0];
    return p->cand[splitmix64(&p->rng) % n];
}

const char *sl_policy_name(enum sl_policy_kind kind)
{
    return kind == SL_POLICY_LRU ? "lru" : "oldest-random";
}

int sl_policy_parse(const char *name, enum sl_policy_kind *out, sl_err *err)
{
    if (!strcmp(name, "oldest-random"))
        *out = SL_POLICY_OLDEST_RANDOM;
    else if (!strcmp(name, "lru"))
        *out = SL_POLICY_LRU;
    else
        return sl_err_set(err, SL_EINVAL,
                          "unknown eviction policy '%s' (expected oldest-random or lru)", name);
    return 0;
}
