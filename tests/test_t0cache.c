/* test_t0cache.c - the device tier's bookkeeping and admission (compute/t0cache.h). */
#include <criterion/criterion.h>
#include <string.h>

#include "t0cache.h"

static void open_cache(sl_t0cache *t, uint32_t slots, uint32_t keys, int admit)
{
    sl_err err = {0};
    cr_assert_eq(sl_t0cache_init(t, slots, keys, admit, 1, &err), 0, "%s", err.msg);
}

/* A miss of key as the engine takes it: asked, claimed, filled when taken. */
static uint32_t miss(sl_t0cache *t, uint32_t key)
{
    sl_t0cache_ask(t, key);
    uint32_t evicted;
    const uint32_t slot = sl_t0cache_claim(t, key, &evicted);
    if (slot != SL_T0_NONE) sl_t0cache_fill(t, slot, key);
    return slot;
}

Test(t0cache, always_takes_every_miss_and_evicts_the_old)
{
    sl_t0cache t;
    open_cache(&t, 4, 100, SL_T0_ADMIT_ALWAYS);
    for (uint32_t k = 0; k < 4; k++) {
        cr_assert_neq(miss(&t, k), SL_T0_NONE);
        sl_t0cache_layer_done(&t);
    }
    for (uint32_t k = 0; k < 4; k++) cr_assert_neq(sl_t0cache_slot(&t, k), SL_T0_NONE);
    /* a fifth expert evicts one of the four; the table follows */
    uint32_t evicted;
    sl_t0cache_ask(&t, 50);
    const uint32_t slot = sl_t0cache_claim(&t, 50, &evicted);
    cr_assert_neq(slot, SL_T0_NONE);
    cr_assert_lt(evicted, 4);
    cr_assert_eq(sl_t0cache_slot(&t, evicted), SL_T0_NONE, "the evicted key left the table");
    sl_t0cache_fill(&t, slot, 50);
    cr_assert_eq(sl_t0cache_slot(&t, 50), slot);
    cr_assert_eq(t.fills, 5);
    cr_assert_eq(t.refused, 0);
    sl_t0cache_free(&t);
}

Test(t0cache, slots_in_use_this_layer_are_never_evicted)
{
    sl_t0cache t;
    open_cache(&t, 3, 100, SL_T0_ADMIT_ALWAYS);
    for (uint32_t k = 0; k < 3; k++) cr_assert_neq(miss(&t, k), SL_T0_NONE);
    /* the same layer: every slot is in use, so a fourth miss is read in place */
    uint32_t evicted;
    cr_assert_eq(sl_t0cache_claim(&t, 9, &evicted), SL_T0_NONE);
    cr_assert_eq(evicted, SL_T0_NONE);
    sl_t0cache_layer_done(&t);
    /* the next layer uses keys 0 and 2: only key 1's slot may go */
    sl_t0cache_hit(&t, sl_t0cache_slot(&t, 0));
    sl_t0cache_hit(&t, sl_t0cache_slot(&t, 2));
    const uint32_t one = sl_t0cache_slot(&t, 1);
    cr_assert_eq(miss(&t, 9), one);
    sl_t0cache_free(&t);
}

Test(t0cache, freq_keeps_the_popular_and_reads_the_rare_in_place)
{
    sl_t0cache t;
    open_cache(&t, 2, 100, SL_T0_ADMIT_FREQ);
    /* keys 1 and 2 are asked for often */
    for (int r = 0; r < 5; r++) {
        for (uint32_t k = 1; k <= 2; k++) {
            const uint32_t s = sl_t0cache_slot(&t, k);
            if (s == SL_T0_NONE)
                cr_assert_neq(miss(&t, k), SL_T0_NONE, "empty slots take anyone");
            else {
                sl_t0cache_ask(&t, k);
                sl_t0cache_hit(&t, s);
            }
        }
        sl_t0cache_layer_done(&t);
    }
    /* a key asked once does not push either out: read in place, counted */
    cr_assert_eq(sl_t0cache_would_take(&t, 7), 0);
    cr_assert_eq(miss(&t, 7), SL_T0_NONE);
    cr_assert_eq(t.refused, 1);
    cr_assert_neq(sl_t0cache_slot(&t, 1), SL_T0_NONE);
    cr_assert_neq(sl_t0cache_slot(&t, 2), SL_T0_NONE);
    sl_t0cache_layer_done(&t);
    /* once asked for more often than a resident one, it gets in */
    uint32_t slot = SL_T0_NONE;
    for (int r = 0; r < 8 && slot == SL_T0_NONE; r++) {
        slot = miss(&t, 7);
        sl_t0cache_layer_done(&t);
    }
    cr_assert_neq(slot, SL_T0_NONE, "a key that became popular is admitted");
    cr_assert_eq(sl_t0cache_slot(&t, 7), slot);
    sl_t0cache_free(&t);
}

Test(t0cache, always_asks_no_victim_to_answer_would_take)
{
    /* Two caches fed the same misses, one also asked would_take each time: under
     * `always` the answers cost no draw, so both evict the same slots. */
    sl_t0cache a, b;
    open_cache(&a, 100, 1000, SL_T0_ADMIT_ALWAYS); /* victims drawn among 8 */
    open_cache(&b, 100, 1000, SL_T0_ADMIT_ALWAYS);
    for (uint32_t k = 0; k < 1000; k++) {
        const uint32_t key = (k * 37) % 1000;
        cr_assert(sl_t0cache_would_take(&b, key));
        cr_assert_eq(miss(&a, key), miss(&b, key), "miss %u", k);
        sl_t0cache_layer_done(&a);
        sl_t0cache_layer_done(&b);
    }
    sl_t0cache_free(&a);
    sl_t0cache_free(&b);
}

Test(t0cache, names_and_bad_shapes)
{
    int admit = -1;
    sl_err err = {0};
    cr_assert_eq(sl_t0cache_admit_parse("freq", &admit, &err), 0);
    cr_assert_eq(admit, SL_T0_ADMIT_FREQ);
    cr_assert_str_eq(sl_t0cache_admit_name(admit), "freq");
    cr_assert_eq(sl_t0cache_admit_parse("always", &admit, &err), 0);
    cr_assert_eq(admit, SL_T0_ADMIT_ALWAYS);
    cr_assert_eq(sl_t0cache_admit_parse("lfu", &admit, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "--t0-admit lfu"), "%s", err.msg);
    sl_t0cache t;
    cr_assert_eq(sl_t0cache_init(&t, 0, 10, SL_T0_ADMIT_ALWAYS, 1, &err), SL_EINVAL);
    cr_assert_eq(sl_t0cache_init(&t, 4, 10, 7, 1, &err), SL_EINVAL);
}
