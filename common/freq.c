/* freq.c - aged ask counters (freq.h). */
#include "freq.h"

#include <stdlib.h>

int sl_freq_init(sl_freq *f, uint32_t n_key, uint32_t window, sl_err *err)
{
    f->count = NULL;
    if (!n_key || !window)
        return sl_err_set(err, SL_EINVAL, "frequency counters: %u keys, window %u", n_key, window);
    f->count = calloc(n_key, sizeof *f->count);
    if (!f->count) return sl_err_set(err, SL_ENOMEM, "frequency counters: %u keys", n_key);
    f->n_key = n_key;
    f->window = window;
    f->since = 0;
    f->halvings = 0;
    return 0;
}

void sl_freq_free(sl_freq *f)
{
    free(f->count);
    f->count = NULL;
}

void sl_freq_add(sl_freq *f, uint32_t key)
{
    if (++f->since >= f->window) {
        for (uint32_t i = 0; i < f->n_key; i++) f->count[i] >>= 1;
        f->since = 0;
        f->halvings++;
    }
    if (f->count[key] < UINT16_MAX) f->count[key]++;
}
