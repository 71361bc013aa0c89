/* test_fused_plan.c - the fused layer kernel's unit lists (bench/gpu/fused_plan.h): every
 * gate/up and down unit of a layer belongs to exactly one CTA; in a CTA's list only downs
 * of lower entries come before a gate/up unit (what keeps the kernel's waits from
 * deadlocking), none at all unless the list is interleaved by entry (aff >= 2); with one
 * entry a CTA each CTA's downs share their entry. */
#include <criterion/criterion.h>
#include <stdlib.h>

#include "fused_plan.h"

typedef struct shape {
    uint32_t n, tpe, dpe, tr, grid;
} shape;

/* Walks every CTA's list; counts each unit's owners; checks the order rules. Returns the
 * longest and shortest list through *most, *least. */
static void walk(const shape *s, int aff, uint32_t *most, uint32_t *least)
{
    uint8_t *gu = calloc((size_t)s->n * s->tpe + 1, 1), *dn = calloc((size_t)s->n * s->dpe + 1, 1);
    cr_assert(gu && dn);
    *most = 0;
    *least = UINT32_MAX;
    for (uint32_t c = 0; c < s->grid; c++) {
        sl_fused_plan p;
        sl_fused_plan_init(&p, s->n, s->tpe, s->dpe, s->tr, s->grid, c, aff);
        int seen_down = 0;
        uint32_t entry = UINT32_MAX, k = 0, top_down = 0; /* the highest down entry so far */
        for (;; k++) {
            uint32_t j = 0, x = 0;
            const int kind = sl_fused_plan_unit(&p, k, &j, &x);
            if (kind == SL_FP_NONE) break;
            cr_assert_lt(j, s->n, "CTA %u unit %u: entry %u of %u", c, k, j, s->n);
            if (kind == SL_FP_GATEUP) {
                if (aff < 2)
                    cr_assert_not(seen_down, "CTA %u: a gate/up unit after a down", c);
                else
                    cr_assert(!seen_down || top_down < j,
                              "CTA %u aff %d: entry %u's gate/up after entry %u's down", c, aff, j,
                              top_down);
                cr_assert_eq(x % s->tr, 0);
                cr_assert_lt(x / s->tr, s->tpe);
                gu[j * s->tpe + x / s->tr]++;
            } else {
                cr_assert_eq(kind, SL_FP_DOWN);
                cr_assert_lt(x, s->dpe);
                if (!seen_down || j > top_down) top_down = j;
                seen_down = 1;
                dn[j * s->dpe + x]++;
                if (aff == 1) {
                    cr_assert(entry == UINT32_MAX || entry == j, "CTA %u: downs of two entries", c);
                    entry = j;
                }
            }
        }
        if (k > *most) *most = k;
        if (k < *least) *least = k;
    }
    for (uint32_t i = 0; i < s->n * s->tpe; i++)
        cr_assert_eq(gu[i], 1, "n %u grid %u aff %d: gate/up unit %u taken %u times", s->n, s->grid,
                     aff, i, gu[i]);
    for (uint32_t i = 0; i < s->n * s->dpe; i++)
        cr_assert_eq(dn[i], 1, "n %u grid %u aff %d: down unit %u taken %u times", s->n, s->grid,
                     aff, i, dn[i]);
    free(gu);
    free(dn);
}

Test(fused_plan, every_unit_has_exactly_one_cta)
{
    static const uint32_t grids[] = {8, 9, 13, 64, 131, 132, 264, 700};
    for (uint32_t n = 1; n <= 8; n++)
        for (size_t g = 0; g < sizeof grids / sizeof *grids; g++)
            for (int aff = 0; aff < 4; aff++) {
                /* the bench and compute shapes (TR 16, TD 32; TR 8, TD 16) and a tiny one */
                const shape shapes[] = {{n, 144, 160, 16, grids[g]},
                                        {n, 288, 320, 8, grids[g]},
                                        {n, 4, 3, 8, grids[g]}};
                for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
                    uint32_t most, least;
                    walk(&shapes[i], aff, &most, &least);
                }
            }
}

Test(fused_plan, the_layer_spreads_evenly_over_an_h200)
{
    /* 6 routed experts + the shared one, 132 CTAs: about 2128 / 132 = 16.1 units each */
    for (int aff = 0; aff < 4; aff++) {
        const shape s = {7, 144, 160, 16, 132};
        uint32_t most, least;
        walk(&s, aff, &most, &least);
        cr_assert_leq(most, 17, "aff %d: %u units on one CTA", aff, most);
        cr_assert_geq(least, 15, "aff %d: %u units on one CTA", aff, least);
    }
}

Test(fused_plan, an_empty_table_has_no_units)
{
    sl_fused_plan p;
    sl_fused_plan_init(&p, 0, 144, 160, 16, 132, 5, 1);
    uint32_t j, x;
    cr_assert_eq(sl_fused_plan_unit(&p, 0, &j, &x), SL_FP_NONE);
    sl_fused_plan_init(&p, 0, 144, 160, 16, 132, 5, 0);
    cr_assert_eq(sl_fused_plan_unit(&p, 0, &j, &x), SL_FP_NONE);
    sl_fused_plan_init(&p, 0, 144, 160, 16, 132, 5, 2);
    cr_assert_eq(sl_fused_plan_unit(&p, 0, &j, &x), SL_FP_NONE);
}

Test(fused_plan, interleaved_lists_put_each_entrys_downs_after_the_next_gate_ups)
{
    /* one CTA holding the whole list (grid 1): GU 0, GU 1, DN 0, GU 2, DN 1, DN 2 at lag 1;
     * GU 0, GU 1, GU 2, DN 0, DN 1, DN 2 at lag 2 (n = 3, 2 gate/up and 3 down units) */
    static const int want[2][6] = {{0, 1, -1, 2, -2, -3}, {0, 1, 2, -1, -2, -3}};
    for (int lag = 1; lag <= 2; lag++) {
        sl_fused_plan p;
        sl_fused_plan_init(&p, 3, 2, 3, 8, 1, 0, lag + 1);
        uint32_t k = 0;
        for (int b = 0; b < 6; b++) {
            const int gate = want[lag - 1][b] >= 0;
            const uint32_t e = (uint32_t)(gate ? want[lag - 1][b] : -want[lag - 1][b] - 1);
            for (uint32_t i = 0; i < (gate ? 2u : 3u); i++, k++) {
                uint32_t j = 99, x = 99;
                cr_assert_eq(sl_fused_plan_unit(&p, k, &j, &x), gate ? SL_FP_GATEUP : SL_FP_DOWN,
                             "lag %d unit %u", lag, k);
                cr_assert_eq(j, e, "lag %d unit %u: entry %u, not %u", lag, k, j, e);
                cr_assert_eq(x, gate ? 8 * i : i, "lag %d unit %u", lag, k);
            }
        }
        uint32_t j, x;
        cr_assert_eq(sl_fused_plan_unit(&p, k, &j, &x), SL_FP_NONE);
    }
}
