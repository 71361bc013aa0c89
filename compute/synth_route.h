/* synth_route.h - synthetic expert picks for benchmarks (--routing uniform | zipf[:S]).
 *
 * Each layer ranks its experts by a fixed random permutation (from the seed and the
 * layer); an expert of rank r is drawn with weight 1 / (r + 1)^s (s = 0: uniform), and
 * a token takes n_used distinct draws, deterministically from (seed, step, layer). The
 * compute process and bench-t0sim draw the same picks from the same seed.
 */
#ifndef SL_SYNTH_ROUTE_H
#define SL_SYNTH_ROUTE_H

#include <stdint.h>

#include "err.h"
#include "moe_types.h"

typedef struct sl_synth_route {
    uint32_t n_layer, n_expert, n_used;
    float weight; /* every pick's routing weight */
    uint64_t seed;
    double *cdf;    /* [n_expert] cumulative popularity of rank r */
    uint32_t *perm; /* [n_layer][n_expert] expert of rank r in layer l */
} sl_synth_route;

static inline uint64_t sl_splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* zipf_s >= 0 (0: uniform); 0 < n_used <= n_expert, n_used <= 64 (sl_moe_route). */
int sl_synth_route_init(sl_synth_route *r, uint32_t n_layer, uint32_t n_expert, uint32_t n_used,
                        double zipf_s, uint64_t seed, float weight, sl_err *err);
void sl_synth_route_free(sl_synth_route *r);

/* The picks of token `step` in `layer` (weights: r->weight each, zero past n_used). */
void sl_synth_route_pick(const sl_synth_route *r, uint64_t step, uint32_t layer,
                         sl_moe_route *route);

#endif
