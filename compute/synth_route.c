/* synth_route.c - synthetic expert picks (synth_route.h). */
#include "synth_route.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int sl_synth_route_init(sl_synth_route *r, uint32_t n_layer, uint32_t n_expert, uint32_t n_used,
                        double zipf_s, uint64_t seed, float weight, sl_err *err)
{
    memset(r, 0, sizeof *r);
    if (!n_layer || !n_expert || !n_used || n_used > n_expert || n_used > 64 || !(zipf_s >= 0.0))
        return sl_err_set(err, SL_EINVAL,
                          "synthetic routing: %u of %u experts in %u layers, s = %g", n_used,
                          n_expert, n_layer, zipf_s);
    r->cdf = malloc(sizeof(double) * n_expert);
    r->perm = malloc(sizeof(uint32_t) * n_expert * n_layer);
    if (!r->cdf || !r->perm) {
        sl_synth_route_free(r);
        return sl_err_set(err, SL_ENOMEM, "synthetic routing: out of memory");
    }
    r->n_layer = n_layer;
    r->n_expert = n_expert;
    r->n_used = n_used;
    r->weight = weight;
    r->seed = seed;
    double sum = 0.0;
    for (uint32_t k = 0; k < n_expert; k++) r->cdf[k] = sum += pow((double)k + 1.0, -zipf_s);
    for (uint32_t k = 0; k < n_expert; k++) r->cdf[k] /= sum;
    for (uint32_t l = 0; l < n_layer; l++) {
        uint32_t *p = r->perm + (uint64_t)l * n_expert;
        uint64_t state = seed * 0x9e3779b97f4a7c15ull + l;
        for (uint32_t k = 0; k < n_expert; k++) p[k] = k;
        for (uint32_t k = n_expert - 1; k > 0; k--) {
            state = sl_splitmix64(state);
            uint32_t j = (uint32_t)(state % (k + 1));
            uint32_t t = p[k];
            p[k] = p[j];
            p[j] = t;
        }
    }
    return 0;
}

void sl_synth_route_free(sl_synth_route *r)
{
    free(r->cdf);
    free(r->perm);
    r->cdf = NULL;
    r->perm = NULL;
}

void sl_synth_route_pick(const sl_synth_route *r, uint64_t step, uint32_t layer,
                         sl_moe_route *route)
{
    const uint32_t n = r->n_expert;
    uint64_t state = sl_splitmix64(r->seed ^ (step * 0x100000001b3ull) ^ ((uint64_t)layer << 48));
    memset(route, 0, sizeof *route);
    for (uint32_t i = 0; i < r->n_used;) {
        state = sl_splitmix64(state);
        const double u = (double)(state >> 11) / 9007199254740992.0;
        uint32_t lo = 0, hi = n - 1;
        while (lo < hi) {
            const uint32_t mid = (lo + hi) / 2;
            if (r->cdf[mid] > u)
                hi = mid;
            else
                lo = mid + 1;
        }
        const uint32_t e = r->perm[(uint64_t)layer * n + lo];
        int dup = 0;
        for (uint32_t k = 0; k < i; k++) dup |= route->expert[k] == e;
        if (dup) continue;
        route->expert[i] = e;
        route->weight[i] = r->weight;
        i++;
    }
}
