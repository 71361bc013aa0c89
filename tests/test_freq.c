/* test_freq.c - aged ask counters (common/freq.h) and the synthetic routing
 * (compute/synth_route.h) that the device tier's admission is measured with. */
#include <criterion/criterion.h>
#include <string.h>

#include "freq.h"
#include "synth_route.h"

Test(freq, counts_then_halves_every_window)
{
    sl_freq f;
    sl_err err = {0};
    cr_assert_eq(sl_freq_init(&f, 8, 10, &err), 0, "%s", err.msg);
    for (int i = 0; i < 9; i++) sl_freq_add(&f, 3);
    cr_assert_eq(sl_freq_get(&f, 3), 9);
    cr_assert_eq(sl_freq_get(&f, 2), 0);
    cr_assert_eq(f.halvings, 0);
    /* the 10th ask halves first (9 -> 4), then counts (5) */
    sl_freq_add(&f, 3);
    cr_assert_eq(f.halvings, 1);
    cr_assert_eq(sl_freq_get(&f, 3), 5);
    /* an old favourite fades behind a new one within a few windows */
    for (int i = 0; i < 40; i++) sl_freq_add(&f, 6);
    cr_assert_gt(sl_freq_get(&f, 6), sl_freq_get(&f, 3));
    cr_assert_eq(sl_freq_get(&f, 3), 0, "4 halvings of 5");
    sl_freq_free(&f);
}

Test(freq, saturates_instead_of_wrapping)
{
    sl_freq f;
    sl_err err = {0};
    cr_assert_eq(sl_freq_init(&f, 2, 1000000, &err), 0, "%s", err.msg);
    for (int i = 0; i < 70000; i++) sl_freq_add(&f, 1);
    cr_assert_eq(sl_freq_get(&f, 1), UINT16_MAX);
    sl_freq_free(&f);
}

Test(freq, refuses_empty_shapes)
{
    sl_freq f;
    sl_err err = {0};
    cr_assert_eq(sl_freq_init(&f, 0, 10, &err), SL_EINVAL);
    cr_assert_eq(sl_freq_init(&f, 10, 0, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "window 0"), "%s", err.msg);
}

Test(synth_route, picks_are_distinct_deterministic_and_skewed)
{
    sl_synth_route z, u;
    sl_err err = {0};
    cr_assert_eq(sl_synth_route_init(&z, 4, 384, 6, 1.0, 7, 0.25f, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_synth_route_init(&u, 4, 384, 6, 0.0, 7, 0.25f, &err), 0, "%s", err.msg);
    static uint32_t hz[384], hu[384];
    for (uint64_t step = 0; step < 4000; step++) {
        sl_moe_route a, b;
        sl_synth_route_pick(&z, step, 2, &a);
        sl_synth_route_pick(&z, step, 2, &b);
        cr_assert_eq(memcmp(&a, &b, sizeof a), 0, "the same (seed, step, layer), the same picks");
        for (int i = 0; i < 6; i++) {
            cr_assert_lt(a.expert[i], 384);
            cr_assert_eq(a.weight[i], 0.25f);
            for (int k = 0; k < i; k++) cr_assert_neq(a.expert[k], a.expert[i]);
            hz[a.expert[i]]++;
        }
        cr_assert_eq(a.expert[6], 0, "nothing past n_used");
        sl_synth_route_pick(&u, step, 2, &b);
        for (int i = 0; i < 6; i++) hu[b.expert[i]]++;
    }
    /* Zipf(1): the top expert (rank 0 of layer 2's ranking) takes about 1 / H(384) ~ 15%
     * of the draws; uniform about 1 / 384 each. */
    const uint32_t top = z.perm[2 * 384];
    cr_assert_gt(hz[top], 4000 * 6 / 10, "top expert drawn %u times", hz[top]);
    uint32_t umax = 0;
    for (int e = 0; e < 384; e++) umax = hu[e] > umax ? hu[e] : umax;
    cr_assert_lt(umax, 4000 * 6 / 384 * 2, "uniform: an expert drawn %u times", umax);
    sl_moe_route c;
    sl_synth_route_pick(&z, 1, 2, &c);
    sl_moe_route d;
    sl_synth_route_pick(&z, 2, 2, &d);
    cr_assert_neq(memcmp(&c, &d, sizeof c), 0, "steps differ");
    sl_synth_route_free(&z);
    sl_synth_route_free(&u);
}

Test(synth_route, refuses_bad_shapes)
{
    sl_synth_route r;
    sl_err err = {0};
    cr_assert_eq(sl_synth_route_init(&r, 4, 8, 9, 1.0, 1, 1.0f, &err), SL_EINVAL);
    cr_assert_eq(sl_synth_route_init(&r, 4, 8, 2, -1.0, 1, 1.0f, &err), SL_EINVAL);
    cr_assert_eq(sl_synth_route_init(&r, 0, 8, 2, 1.0, 1, 1.0f, &err), SL_EINVAL);
}
