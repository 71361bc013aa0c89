/* test_fused_plan.c - the fused layer kernel's unit lists (bench/gpu/fused_plan.h): every
 * gate/up and down unit of a layer belongs to exactly one CTA, a CTA's gate/up units come
 * before its downs (what keeps the kernel's waits from deadlocking), and with one entry a
 * CTA each CTA's downs share their entry. */
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
        uint32_t entry = UINT32_MAX, k = 0;
        for (;; k++) {
            uint32_t j = 0, x = 0;
            const int kind = sl_fused_plan_unit(&p, k, &j, &x);
            if (kind == SL_FP_NONE) break;
            cr_assert_lt(j, s->n, "CTA %u unit %u: entry %u of %u", c, k, j, s->n);
            if (kind == SL_FP_GATEUP) {
                cr_assert_not(seen_down, "CTA %u: a gate/up unit after a down", c);
                cr_assert_eq(x % s->tr, 0);
                cr_assert_lt(x / s->tr, s->tpe);
                gu[j * s->tpe + x / s->tr]++;
            } else {
                cr_assert_eq(kind, SL_FP_DOWN);
                cr_assert_lt(x, s->dpe);
                seen_down = 1;
                dn[j * s->dpe + x]++;
                if (aff) {
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
            for (int aff = 0; aff < 2; aff++) {
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
    for (int aff = 0; aff < 2; aff++) {
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
}
