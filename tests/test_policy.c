/* test_policy.c - the eviction policies: order, pins, determinism, and the cyclic
 * working set just over capacity where strict LRU thrashes. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"

static int busy_from_array(void *ctx, uint32_t slot)
{
    return ((const uint8_t *)ctx)[slot];
}

static sl_policy *make(enum sl_policy_kind kind, uint32_t n, uint64_t seed)
{
    sl_policy *p = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_policy_init(&p, kind, n, seed, &err), 0, "%s", err.msg);
    return p;
}

Test(policy, lru_evicts_least_recent_and_skips_busy)
{
    sl_policy *p = make(SL_POLICY_LRU, 4, 1);
    /* Fresh slots are oldest first in index order. */
    cr_assert_eq(sl_policy_victim(p, NULL, NULL), 0);
    for (uint32_t s = 0; s < 4; s++) sl_policy_touch(p, s);
    sl_policy_touch(p, 0); /* order now 1 2 3 0 */
    cr_assert_eq(sl_policy_victim(p, NULL, NULL), 1);
    uint8_t busy[4] = {0, 1, 0, 0};
    cr_assert_eq(sl_policy_victim(p, busy_from_array, busy), 2);
    sl_policy_forget(p, 3); /* order 3 1 2 0 */
    cr_assert_eq(sl_policy_victim(p, NULL, NULL), 3);
    memset(busy, 1, sizeof busy);
    cr_assert_eq(sl_policy_victim(p, busy_from_array, busy), -1);
    sl_policy_free(&p);
    cr_assert_null(p);
}

Test(policy, random_victim_stays_in_oldest_share)
{
    const uint32_t n = 100; /* 8% -> the 8 oldest */
    sl_policy *p = make(SL_POLICY_OLDEST_RANDOM, n, 7);
    for (uint32_t s = 0; s < n; s++) sl_policy_touch(p, (s * 37) % n); /* order: s*37 mod n */
    int seen[100] = {0};
    for (int i = 0; i < 2000; i++) {
        int64_t v = sl_policy_victim(p, NULL, NULL);
        cr_assert(v >= 0 && v < n);
        seen[v]++;
    }
    for (uint32_t k = 0; k < n; k++) {
        uint32_t s = (k * 37) % n;
        if (k < 8)
            cr_assert_gt(seen[s], 100, "slot %u (age rank %u) drawn %d times", s, k, seen[s]);
        else
            cr_assert_eq(seen[s], 0, "slot %u (age rank %u) is not among the oldest 8%%", s, k);
    }
    sl_policy_free(&p);
}

Test(policy, never_picks_a_busy_slot)
{
    const uint32_t n = 64;
    sl_policy *p = make(SL_POLICY_OLDEST_RANDOM, n, 3);
    uint8_t busy[64];
    uint64_t s = 12345;
    for (int round = 0; round < 500; round++) {
        int free_left = 0;
        for (uint32_t i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            busy[i] = (s >> 33) % 4 != 0; /* ~75% busy */
            free_left += !busy[i];
        }
        int64_t v = sl_policy_victim(p, busy_from_array, busy);
        if (v < 0) {
            cr_assert_eq(free_left, 0);
        } else {
            cr_assert_eq(busy[v], 0, "round %d picked busy slot %lld", round, (long long)v);
            sl_policy_touch(p, (uint32_t)v);
        }
    }
    sl_policy_free(&p);
}

Test(policy, same_seed_same_victims)
{
    sl_policy *a = make(SL_POLICY_OLDEST_RANDOM, 200, 99);
    sl_policy *b = make(SL_POLICY_OLDEST_RANDOM, 200, 99);
    sl_policy *c = make(SL_POLICY_OLDEST_RANDOM, 200, 100);
    int differs = 0;
    for (int i = 0; i < 300; i++) {
        int64_t va = sl_policy_victim(a, NULL, NULL), vb = sl_policy_victim(b, NULL, NULL);
        int64_t vc = sl_policy_victim(c, NULL, NULL);
        cr_assert_eq(va, vb);
        differs |= va != vc;
        sl_policy_touch(a, (uint32_t)va);
        sl_policy_touch(b, (uint32_t)vb);
        sl_policy_touch(c, (uint32_t)vc);
    }
    cr_assert(differs, "another seed should give another victim sequence");
    sl_policy_free(&a);
    sl_policy_free(&b);
    sl_policy_free(&c);
}

/* A cache of n_slot slots over items, driven by an access sequence; returns hits. */
static uint32_t simulate(enum sl_policy_kind kind, uint32_t n_slot, uint32_t n_item,
                         const uint32_t *seq, uint32_t n_seq)
{
    sl_policy *p = make(kind, n_slot, 5);
    int32_t *slot_of = malloc(sizeof(int32_t) * n_item);
    int32_t *item_in = malloc(sizeof(int32_t) * n_slot);
    for (uint32_t i = 0; i < n_item; i++) slot_of[i] = -1;
    for (uint32_t s = 0; s < n_slot; s++) item_in[s] = -1;
    uint32_t hits = 0;
    for (uint32_t k = 0; k < n_seq; k++) {
        uint32_t it = seq[k];
        if (slot_of[it] >= 0) {
            hits++;
            sl_policy_touch(p, (uint32_t)slot_of[it]);
            continue;
        }
        int64_t v = sl_policy_victim(p, NULL, NULL);
        cr_assert(v >= 0);
        if (item_in[v] >= 0) slot_of[item_in[v]] = -1;
        item_in[v] = (int32_t)it;
        slot_of[it] = (int32_t)v;
        sl_policy_touch(p, (uint32_t)v);
    }
    free(slot_of);
    free(item_in);
    sl_policy_free(&p);
    return hits;
}

Test(policy, cyclic_working_set_just_over_capacity)
{
    /* 1000 slots, a cycle over 1050 items (5% over): LRU always evicts the item that
     * comes back soonest and never hits; the random pick among the oldest 8% keeps
     * part of the cycle resident (32% of accesses hit with this seed; the bound
     * leaves room for other seeds). */
    const uint32_t n_slot = 1000, n_item = 1050, rounds = 20;
    uint32_t n_seq = n_item * rounds;
    uint32_t *seq = malloc(sizeof(uint32_t) * n_seq);
    for (uint32_t k = 0; k < n_seq; k++) seq[k] = k % n_item;
    uint32_t lru = simulate(SL_POLICY_LRU, n_slot, n_item, seq, n_seq);
    uint32_t rnd = simulate(SL_POLICY_OLDEST_RANDOM, n_slot, n_item, seq, n_seq);
    free(seq);
    cr_assert_eq(lru, 0, "strict LRU should thrash on a cycle over capacity, got %u hits", lru);
    cr_assert_gt(rnd, n_seq / 5, "oldest-random kept only %u of %u accesses", rnd, n_seq);
}

Test(policy, skewed_workload_both_hit_the_hot_set)
{
    /* A hot set of 100 items takes 90% of 20000 accesses, the rest spread over 5000
     * items; with 500 slots both policies must keep the hot set resident. */
    const uint32_t n_slot = 500, n_item = 5100, n_seq = 20000;
    uint32_t *seq = malloc(sizeof(uint32_t) * n_seq);
    uint64_t s = 42;
    for (uint32_t k = 0; k < n_seq; k++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t r = (uint32_t)(s >> 33);
        seq[k] = r % 10 ? r % 100 : 100 + (r / 10) % 5000;
    }
    uint32_t lru = simulate(SL_POLICY_LRU, n_slot, n_item, seq, n_seq);
    uint32_t rnd = simulate(SL_POLICY_OLDEST_RANDOM, n_slot, n_item, seq, n_seq);
    free(seq);
    cr_assert_gt(lru, n_seq * 85 / 100, "lru hits %u", lru);
    cr_assert_gt(rnd, n_seq * 85 / 100, "oldest-random hits %u", rnd);
}

Test(policy, bad_arguments)
{
    sl_policy *p = NULL;
    sl_err err = {0};
    cr_assert_eq(sl_policy_init(&p, SL_POLICY_LRU, 0, 1, &err), SL_EINVAL);
    cr_assert_null(p);
    cr_assert(strstr(err.msg, "0 slots"));
    enum sl_policy_kind k;
    cr_assert_eq(sl_policy_parse("lru", &k, &err), 0);
    cr_assert_eq(k, SL_POLICY_LRU);
    cr_assert_eq(sl_policy_parse("oldest-random", &k, &err), 0);
    cr_assert_eq(k, SL_POLICY_OLDEST_RANDOM);
    cr_assert_eq(sl_policy_parse("fifo", &k, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "fifo"));
}

Test(policy, empty_slots_are_used_before_anything_is_evicted)
{
    /* 100 slots, 90 filled: the random pick among the oldest 8 must not evict a
     * filled slot while 10 empty ones remain. */
    sl_policy *p = make(SL_POLICY_OLDEST_RANDOM, 100, 11);
    uint8_t filled[100] = {0};
    for (int i = 0; i < 100; i++) {
        int64_t v = sl_policy_victim(p, NULL, NULL);
        cr_assert(v >= 0);
        cr_assert_eq(filled[v], 0, "fill %d evicted filled slot %lld", i, (long long)v);
        filled[v] = 1;
        sl_policy_touch(p, (uint32_t)v);
    }
    /* A forgotten slot is the next one used. */
    sl_policy_forget(p, 42);
    cr_assert_eq(sl_policy_victim(p, NULL, NULL), 42);
    sl_policy_free(&p);
}
