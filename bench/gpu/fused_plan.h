/* fused_plan.h - the unit list of one CTA of the fused layer kernel (k_moe_fused_q2q3, a
 * bench variant: bench/gpu/moe_sandbox.cuh).
 *
 * Plain C shared by the kernel and the host tests: with n table entries, tpe gate/up
 * units an entry (tr rows each) and dpe down units an entry (one tile of output rows
 * each), CTA cta of grid takes, in order:
 *   - the gate/up units u = cta, cta + grid, ... < n * tpe (entry u / tpe, rows
 *     (u % tpe) * tr), the same round-robin as the two-launch gate/up;
 *   - then its down units: round-robin too (aff 0: unit n * tpe + d = cta + k * grid,
 *     entry d / dpe, tile d % dpe), or one entry a CTA (aff 1: entry cta % n, tiles
 *     cta / n, cta / n + P, ... with P the CTAs of that entry), so that a CTA's downs
 *     share one activation. aff 1 needs grid >= n, or some entry has no CTA.
 * aff L + 1 (L >= 1): one round-robin list interleaved by entry instead, entry e's
 * downs right after entry e + L's gate/ups (GU 0, .., GU L, DN 0, GU L + 1, DN 1, ..,
 * DN n - 1), so that the downs of the first entries decode while the later entries'
 * gate/up bytes stream. A down of entry e then comes after every gate/up unit of e, and
 * in a CTA's list only downs of lower entries come before a gate/up unit: with every
 * CTA resident the kernel's waits for h cannot deadlock (each entry's gate/ups finish
 * once the lower entries' downs have).
 * Every unit of the list belongs to exactly one CTA (tests/test_fused_plan.c).
 */
#ifndef SL_FUSED_PLAN_H
#define SL_FUSED_PLAN_H

#include <stdint.h>

#ifdef __CUDACC__
#define SL_FP_FN __host__ __device__ static inline
#else
#define SL_FP_FN static inline
#endif

enum { SL_FP_NONE, SL_FP_GATEUP, SL_FP_DOWN };

typedef struct sl_fused_plan {
    uint32_t n, tpe, dpe, tr, grid, cta;
    int aff;
    uint32_t gu;  /* gate/up units of the whole list */
    uint32_t kg;  /* aff: this CTA's gate/up units */
    uint32_t ax;  /* aff: its entry */
    uint32_t aq0; /* aff: its first tile */
    uint32_t ap;  /* aff: the step between its tiles (the CTAs of its entry) */
} sl_fused_plan;

SL_FP_FN void sl_fused_plan_init(sl_fused_plan *p, uint32_t n, uint32_t tpe, uint32_t dpe,
                                 uint32_t tr, uint32_t grid, uint32_t cta, int aff)
{
    p->n = n;
    p->tpe = tpe;
    p->dpe = dpe;
    p->tr = tr;
    p->grid = grid;
    p->cta = cta;
    p->aff = aff;
    p->gu = n * tpe;
    p->kg = cta < p->gu ? (p->gu - 1 - cta) / grid + 1 : 0;
    p->ax = n ? cta % n : 0;
    p->aq0 = n ? cta / n : 0;
    p->ap = n && p->ax < grid ? (grid - 1 - p->ax) / n + 1 : 1;
}

/* The CTA's k-th unit: SL_FP_NONE past the end of its list, SL_FP_GATEUP (entry *j, first
 * row *x) or SL_FP_DOWN (entry *j, tile *x). The list ends at the first NONE. */
SL_FP_FN int sl_fused_plan_unit(const sl_fused_plan *p, uint32_t k, uint32_t *j, uint32_t *x)
{
    const uint64_t u = (uint64_t)p->cta + (uint64_t)k * p->grid;
    if (!p->n) return SL_FP_NONE;
    if (p->aff >= 2) { /* step i: entry i's gate/ups (i < n), then entry i - L's downs */
        const uint32_t lag = (uint32_t)p->aff - 1;
        uint64_t at = 0;
        for (uint32_t i = 0; i < p->n + lag; i++) {
            if (i < p->n) {
                if (u < at + p->tpe) {
                    *j = i;
                    *x = (uint32_t)(u - at) * p->tr;
                    return SL_FP_GATEUP;
                }
                at += p->tpe;
            }
            if (i >= lag) {
                if (u < at + p->dpe) {
                    *j = i - lag;
                    *x = (uint32_t)(u - at);
                    return SL_FP_DOWN;
                }
                at += p->dpe;
            }
        }
        return SL_FP_NONE;
    }
    if (p->aff ? k < p->kg : u < p->gu) {
        *j = (uint32_t)(u / p->tpe);
        *x = (uint32_t)(u % p->tpe) * p->tr;
        return SL_FP_GATEUP;
    }
    if (p->aff) {
        const uint64_t t = (uint64_t)p->aq0 + (uint64_t)(k - p->kg) * p->ap;
        if (t >= p->dpe) return SL_FP_NONE;
        *j = p->ax;
        *x = (uint32_t)t;
        return SL_FP_DOWN;
    }
    if (u >= (uint64_t)p->gu + (uint64_t)p->n * p->dpe) return SL_FP_NONE;
    *j = (uint32_t)((u - p->gu) / p->dpe);
    *x = (uint32_t)((u - p->gu) % p->dpe);
    return SL_FP_DOWN;
}

#endif
