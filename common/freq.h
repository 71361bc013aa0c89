/* freq.h - how often each key was asked for lately: exact counters that halve together
 * every `window` asks, so that old popularity fades (the aging of TinyLFU, with exact
 * counts instead of a sketch: the keys are a layer's experts, a few tens of thousands).
 *
 * The device tier (T0) uses it to admit an expert only when it was asked for more often
 * than the one it would evict (compute's --t0-admit freq). Not thread-safe.
 */
#ifndef SL_FREQ_H
#define SL_FREQ_H

#include <stdint.h>

#include "err.h"

typedef struct sl_freq {
    uint16_t *count; /* [n_key], saturating */
    uint32_t n_key;
    uint32_t window;   /* asks between two halvings */
    uint32_t since;    /* asks since the last halving */
    uint64_t halvings; /* how many so far */
} sl_freq;

/* n_key > 0 counters at zero; window > 0. */
int sl_freq_init(sl_freq *f, uint32_t n_key, uint32_t window, sl_err *err);
void sl_freq_free(sl_freq *f);

/* One ask of key (< n_key); every window-th ask halves every counter first. */
void sl_freq_add(sl_freq *f, uint32_t key);

static inline uint32_t sl_freq_get(const sl_freq *f, uint32_t key)
{
    return f->count[key];
}

#endif
