/* t0cache.h - which experts the device tier (T0) holds, and which miss it takes in.
 *
 * The bookkeeping of sluice-compute's T0 (compute/engine.c does the copies and the
 * device's table around it) and of bench-t0sim, which replays routings through the
 * same code: the slot of each (layer, expert) key, the key of each slot, the slots the
 * current layer uses (never evicted), the eviction policy (common/policy.h) and the
 * admission of a miss:
 *  - SL_T0_ADMIT_ALWAYS: every miss is copied into T0, evicting the policy's victim;
 *  - SL_T0_ADMIT_FREQ: a miss takes an occupied slot only when it was asked for more
 *    often lately (common/freq.h, halved every SL_T0_FREQ_WINDOW asks per slot) than
 *    the expert it would evict; otherwise it is read in place from T1 this time. An
 *    expert asked once does not push out one asked often (TinyLFU's rule).
 * Not thread-safe.
 */
#ifndef SL_T0CACHE_H
#define SL_T0CACHE_H

#include <stdint.h>

#include "err.h"
#include "freq.h"
#include "policy.h"

#define SL_T0_NONE UINT32_MAX

/* Asks between two halvings of the counters, per T0 slot. */
#define SL_T0_FREQ_WINDOW 10

enum sl_t0_admit {
    SL_T0_ADMIT_ALWAYS = 0,
    SL_T0_ADMIT_FREQ = 1,
};

typedef struct sl_t0cache {
    uint32_t n_slot, n_key;
    int admit;         /* enum sl_t0_admit */
    sl_policy *policy; /* over the slots */
    uint32_t *slot_of; /* [n_key] slot, SL_T0_NONE when absent */
    uint32_t *owner;   /* [n_slot] key, SL_T0_NONE when empty */
    uint8_t *in_use;   /* [n_slot] 1 while the current layer uses it */
    sl_freq freq;      /* asks per key */
    uint64_t fills;    /* misses taken in */
    uint64_t refused;  /* misses left in T1 by the admission */
} sl_t0cache;

/* n_slot > 0 slots for n_key keys, all empty; seed drives the policy's random pick. */
int sl_t0cache_init(sl_t0cache *t, uint32_t n_slot, uint32_t n_key, int admit, uint64_t seed,
                    sl_err *err);
void sl_t0cache_free(sl_t0cache *t);

static inline uint32_t sl_t0cache_slot(const sl_t0cache *t, uint32_t key)
{
    return t->slot_of[key];
}

/* The layer picked key (every pick, hit or miss, before sl_t0cache_claim). */
void sl_t0cache_ask(sl_t0cache *t, uint32_t key);

/* key's slot serves the layer: kept until sl_t0cache_layer_done, and now the newest. */
void sl_t0cache_hit(sl_t0cache *t, uint32_t slot);

/* A miss of key: the slot it is to be copied into, emptied (*evicted: the key it held,
 * SL_T0_NONE if none), or SL_T0_NONE when it stays out (every slot in use, or the
 * admission refused it: read it in place). sl_t0cache_fill follows once the copy is
 * queued; if the copy cannot be queued the slot simply stays empty. */
uint32_t sl_t0cache_claim(sl_t0cache *t, uint32_t key, uint32_t *evicted);

/* Whether sl_t0cache_claim would take key in now: always 1 under SL_T0_ADMIT_ALWAYS
 * (even when every slot is in use); under SL_T0_ADMIT_FREQ it draws the policy's victim,
 * and a random policy's later draw may differ. */
int sl_t0cache_would_take(sl_t0cache *t, uint32_t key);

/* key now lives in slot (claimed): in use by this layer, the newest. */
void sl_t0cache_fill(sl_t0cache *t, uint32_t slot, uint32_t key);

/* The layer's work is queued: its slots may be evicted again. */
void sl_t0cache_layer_done(sl_t0cache *t);

const char *sl_t0cache_admit_name(int admit);
int sl_t0cache_admit_parse(const char *name, int *admit, sl_err *err);

#endif
