/* t0sim.c - `bench-t0sim`: the device tier's hit rate and copies under each admission
 * (compute/t0cache.h), replaying the synthetic routings of `sluice bench moe` through
 * the same bookkeeping sluice-compute runs, with no GPU and no checkpoint.
 *
 * Per layer it does what sluice-compute's gather does with T0: count every pick, take
 * the T0 hits, then the misses in rank order, each either queued for a copy into T0
 * (last, as the engine orders them) or read in place from T1. Misses of T0 are T1 hits
 * here (the steady state of run (b): the host arena holds every expert). Each bench run
 * prints a markdown table; what it cannot say is the time: the copies and in-place
 * reads cross the same host link, and the GPU run (bench/run-moe-e2e.sh with
 * --t0-admit) measures what each costs.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opts.h"
#include "synth_route.h"
#include "t0cache.h"

typedef struct sim_opts {
    uint32_t layers, experts, used, slots;
    uint32_t warmup, steps;
    uint64_t seed;
    const char *out;
} sim_opts;

typedef struct sim_result {
    uint64_t asked, hits, copies, in_place;
} sim_result;

static void die(const char *what, const sl_err *e)
{
    fprintf(stderr, "bench-t0sim: %s%s%s\n", what, e ? ": " : "", e ? e->msg : "");
    exit(1);
}

static sim_result run(const sim_opts *o, double zipf_s, int admit)
{
    sl_synth_route r;
    sl_t0cache t;
    sl_err err = {0};
    if (sl_synth_route_init(&r, o->layers, o->experts, o->used, zipf_s, o->seed, 1.0f, &err))
        die("routing", &err);
    if (sl_t0cache_init(&t, o->slots, o->layers * o->experts, admit, 1, &err))
        die("device tier", &err);
    sim_result res = {0, 0, 0, 0};
    for (uint64_t step = 0; step < (uint64_t)o->warmup + o->steps; step++) {
        const int count = step >= o->warmup;
        for (uint32_t l = 0; l < o->layers; l++) {
            sl_moe_route route;
            sl_synth_route_pick(&r, step, l, &route);
            uint32_t later[64], n_later = 0;
            uint32_t miss[64], n_miss = 0;
            for (uint32_t i = 0; i < o->used; i++) {
                const uint32_t key = l * o->experts + route.expert[i];
                sl_t0cache_ask(&t, key);
                const uint32_t slot = sl_t0cache_slot(&t, key);
                if (slot != SL_T0_NONE) {
                    sl_t0cache_hit(&t, slot);
                    res.hits += count;
                } else {
                    miss[n_miss++] = key;
                }
            }
            /* the engine's arrival order: what will not be copied first, the copies last */
            for (uint32_t k = 0; k < n_miss; k++)
                if (sl_t0cache_would_take(&t, miss[k]))
                    later[n_later++] = miss[k];
                else
                    miss[k - n_later] = miss[k];
            n_miss -= n_later;
            for (uint32_t k = 0; k < n_miss + n_later; k++) {
                const uint32_t key = k < n_miss ? miss[k] : later[k - n_miss];
                uint32_t evicted;
                const uint32_t slot = sl_t0cache_claim(&t, key, &evicted);
                if (slot == SL_T0_NONE) {
                    res.in_place += count;
                } else {
                    sl_t0cache_fill(&t, slot, key);
                    res.copies += count;
                }
            }
            res.asked += count ? o->used : 0;
            sl_t0cache_layer_done(&t);
        }
    }
    sl_t0cache_free(&t);
    sl_synth_route_free(&r);
    return res;
}

enum { T_LAYERS, T_EXPERTS, T_USED, T_SLOTS, T_WARMUP, T_STEPS, T_SEED, T_OUT, T_HELP };

static const sl_opt table[] = {
    {T_LAYERS, NULL, "--layers", "N", "layers (default 4, bench-L4)"},
    {T_EXPERTS, NULL, "--experts", "N", "experts a layer (default 384)"},
    {T_USED, NULL, "--used", "N", "picks a layer (default 6)"},
    {T_SLOTS, NULL, "--slots", "N", "device tier slots (default 768, half of bench-L4)"},
    {T_WARMUP, NULL, "--warmup", "N", "steps before the counting starts (default 64)"},
    {T_STEPS, NULL, "--steps", "N", "steps counted (default 32)"},
    {T_SEED, NULL, "--seed", "N", "seed of the routings (default 7, as run-moe-e2e.sh)"},
    {T_OUT, NULL, "--out", "FILE", "write the table to FILE instead of stdout"},
    {T_HELP, "-h", "--help", NULL, "this help"},
};

int main(int argc, char **argv)
{
    /* the defaults are run (b) of bench/run-moe-e2e.sh on bench-L4 */
    sim_opts o = {4, 384, 6, 768, 64, 32, 7, NULL};
    uint32_t *const count[] = {&o.layers, &o.experts, &o.used, &o.slots, &o.warmup, &o.steps};
    const size_t n_opt = sizeof table / sizeof *table;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        sl_err err = {0};
        const sl_opt *d = sl_opt_next(table, n_opt, argc, argv, &i, &v, &err);
        uint64_t x = 0;
        if (d && d->id == T_HELP) {
            sl_opt_help(stdout,
                        "usage: bench-t0sim [options]\nReplays sluice-compute's synthetic "
                        "routings (uniform, zipf:1.0) through the device tier's bookkeeping "
                        "under each admission (--t0-admit always, freq).",
                        table, n_opt);
            return 0;
        }
        if (d && d->id == T_OUT) {
            o.out = v;
            continue;
        }
        if (d && !sl_opt_u64(d->lng, v, 1, 1u << 30, &x, &err)) {
            if (d->id == T_SEED)
                o.seed = x;
            else
                *count[d->id] = (uint32_t)x;
            continue;
        }
        fprintf(stderr, "bench-t0sim: %s\n", err.msg);
        return 2;
    }
    if (o.used > o.experts || o.used > 64) {
        fprintf(stderr, "bench-t0sim: --used %u of %u experts\n", o.used, o.experts);
        return 2;
    }
    FILE *f = o.out ? fopen(o.out, "w") : stdout;
    if (!f) die("cannot write the --out file", NULL);
    fprintf(f,
            "bench-t0sim: %u layers x %u experts, %u picks a layer, T0 of %u slots (%.0f%%), "
            "seed %" PRIu64 ", %u warm-up steps then %u counted\n\n",
            o.layers, o.experts, o.used, o.slots,
            100.0 * (double)o.slots / ((double)o.layers * o.experts), o.seed, o.warmup, o.steps);
    fprintf(f, "| routing | admission | T0 hits | copies into T0 a step | read in place a step | "
               "host-link experts a step |\n|---|---|---|---|---|---|\n");
    static const struct {
        const char *name;
        double s;
    } routings[] = {{"uniform", 0.0}, {"zipf:1.0", 1.0}};
    for (int k = 0; k < 2; k++)
        for (int admit = SL_T0_ADMIT_ALWAYS; admit <= SL_T0_ADMIT_FREQ; admit++) {
            const sim_result res = run(&o, routings[k].s, admit);
            const double steps = (double)o.steps;
            fprintf(f, "| %s | %s | %.1f%% | %.2f | %.2f | %.2f |\n", routings[k].name,
                    sl_t0cache_admit_name(admit),
                    res.asked ? 100.0 * (double)res.hits / (double)res.asked : 0.0,
                    (double)res.copies / steps, (double)res.in_place / steps,
                    (double)(res.copies + res.in_place) / steps);
        }
    fprintf(f,
            "\ncommand: `bench-t0sim --layers %u --experts %u --used %u --slots %u --warmup %u "
            "--steps %u --seed %" PRIu64 "`\n",
            o.layers, o.experts, o.used, o.slots, o.warmup, o.steps, o.seed);
    if (o.out && fclose(f)) die("writing the --out file", NULL);
    return 0;
}
