/* t0cache.c - the device tier's bookkeeping and admission (t0cache.h). */
#include "t0cache.h"

#include <stdlib.h>
#include <string.h>

int sl_t0cache_init(sl_t0cache *t, uint32_t n_slot, uint32_t n_key, int admit, uint64_t seed,
                    sl_err *err)
{
    memset(t, 0, sizeof *t);
    if (!n_slot || !n_key || (admit != SL_T0_ADMIT_ALWAYS && admit != SL_T0_ADMIT_FREQ))
        return sl_err_set(err, SL_EINVAL, "device tier: %u slots, %u experts, admission %d", n_slot,
                          n_key, admit);
    t->n_slot = n_slot;
    t->n_key = n_key;
    t->admit = admit;
    int rc = sl_policy_init(&t->policy, SL_POLICY_OLDEST_RANDOM, n_slot, seed, err);
    uint64_t window = (uint64_t)n_slot * SL_T0_FREQ_WINDOW;
    if (!rc)
        rc =
            sl_freq_init(&t->freq, n_key, window > UINT32_MAX ? UINT32_MAX : (uint32_t)window, err);
    if (rc) {
        sl_t0cache_free(t);
        return rc;
    }
    t->slot_of = malloc((size_t)n_key * sizeof *t->slot_of);
    t->owner = malloc((size_t)n_slot * sizeof *t->owner);
    t->in_use = calloc(n_slot, 1);
    if (!t->slot_of || !t->owner || !t->in_use) {
        sl_t0cache_free(t);
        return sl_err_set(err, SL_ENOMEM, "device tier: out of memory");
    }
    for (uint32_t i = 0; i < n_key; i++) t->slot_of[i] = SL_T0_NONE;
    for (uint32_t i = 0; i < n_slot; i++) t->owner[i] = SL_T0_NONE;
    return 0;
}

void sl_t0cache_free(sl_t0cache *t)
{
    sl_policy_free(&t->policy);
    sl_freq_free(&t->freq);
    free(t->slot_of);
    free(t->owner);
    free(t->in_use);
    t->slot_of = t->owner = NULL;
    t->in_use = NULL;
}

void sl_t0cache_ask(sl_t0cache *t, uint32_t key)
{
    sl_freq_add(&t->freq, key);
}

void sl_t0cache_hit(sl_t0cache *t, uint32_t slot)
{
    t->in_use[slot] = 1;
    sl_policy_touch(t->policy, slot);
}

static int busy(void *ctx, uint32_t slot)
{
    return ((const sl_t0cache *)ctx)->in_use[slot];
}

/* The admission's verdict on key against the victim slot v. */
static int admits(const sl_t0cache *t, uint32_t key, uint32_t v)
{
    const uint32_t old = t->owner[v];
    return t->admit == SL_T0_ADMIT_ALWAYS || old == SL_T0_NONE ||
           sl_freq_get(&t->freq, key) > sl_freq_get(&t->freq, old);
}

uint32_t sl_t0cache_claim(sl_t0cache *t, uint32_t key, uint32_t *evicted)
{
    *evicted = SL_T0_NONE;
    const int64_t v = sl_policy_victim(t->policy, busy, t);
    if (v < 0) return SL_T0_NONE;
    const uint32_t slot = (uint32_t)v;
    if (!admits(t, key, slot)) {
        t->refused++;
        return SL_T0_NONE;
    }
    if (t->owner[slot] != SL_T0_NONE) {
        *evicted = t->owner[slot];
        t->slot_of[*evicted] = SL_T0_NONE;
        t->owner[slot] = SL_T0_NONE;
    }
    return slot;
}

int sl_t0cache_would_take(sl_t0cache *t, uint32_t key)
{
    /* no draw under `always`: the victims stay those of a run that never asks */
    if (t->admit == SL_T0_ADMIT_ALWAYS) return 1;
    const int64_t v = sl_policy_victim(t->policy, busy, t);
    return v >= 0 && admits(t, key, (uint32_t)v);
}

void sl_t0cache_fill(sl_t0cache *t, uint32_t slot, uint32_t key)
{
    t->owner[slot] = key;
    t->slot_of[key] = slot;
    t->fills++;
    sl_t0cache_hit(t, slot);
}

void sl_t0cache_layer_done(sl_t0cache *t)
{
    memset(t->in_use, 0, t->n_slot);
}

const char *sl_t0cache_admit_name(int admit)
{
    return admit == SL_T0_ADMIT_FREQ ? "freq" : "always";
}

int sl_t0cache_admit_parse(const char *name, int *admit, sl_err *err)
{
    if (!strcmp(name, "always"))
        *admit = SL_T0_ADMIT_ALWAYS;
    else if (!strcmp(name, "freq"))
        *admit = SL_T0_ADMIT_FREQ;
    else
        return sl_err_set(err, SL_EINVAL, "--t0-admit %s: expected always or freq", name);
    return 0;
}
