/* launch.c - bench-launch: what a kernel launch costs on the GPU's side, back to back
 * on one stream, with and without programmatic dependent launch, and whether kernels
 * that need different L1 / shared-memory splits cost more in turn than alike ones
 * (the MoE chain alternates small kernels and ~115 KB bulk-copy kernels); then how
 * long a table of tagged words takes from its writer to many polling CTAs (the
 * selection's handoff to the gate/up's 264 CTAs, lb_handoff).
 *
 * usage: bench-launch [-o FILE.md] [--n N (2000)]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_main.h"
#include "gpu.h"
#include "launch_bench.h"

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The handoff table: each shape's latencies (us from the stores to a poller's sight)
 * over every poller of every launch. */
static int handoff_table(FILE *md)
{
    enum { REPS = 40, WORDS = 25 };
    static const struct {
        int n_poll, sleep_ns, ncopy;
    } shapes[] = {{1, 0, 1},    {32, 0, 1},    {132, 0, 1},  {264, 0, 1}, {528, 0, 1},
                  {264, 32, 1}, {264, 256, 1}, {264, 32, 8}, {264, 0, 8}};
    char line[512];
    snprintf(line, sizeof line,
             "\nA table of %d tagged 64-bit words (the selection's, sl_kttab) from one CTA's "
             "stores to the polling CTAs' sight (a warp each, a word a lane, all tagged in one "
             "round), %d launches, us on %%globaltimer:\n\n| pollers | sleep "
             "between rounds, ns | copies | median | p90 | max | gave up | started after the "
             "stores |\n|---|---|---|---|---|---|---|---|\n",
             WORDS, REPS);
    bm_put(md, line);
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        const int n = shapes[i].n_poll;
        double *lat = malloc(sizeof *lat * (size_t)n * REPS);
        char msg[256] = "";
        int late = 0;
        if (!lat ||
            lb_handoff(n, WORDS, shapes[i].sleep_ns, shapes[i].ncopy, REPS, lat, &late, msg)) {
            fprintf(stderr, "bench-launch: %s\n", lat ? msg : "out of memory");
            free(lat);
            return 1;
        }
        int gave_up = 0, m = 0;
        for (int k = 0; k < n * REPS; k++) {
            if (isnan(lat[k]))
                gave_up++;
            else
                lat[m++] = lat[k];
        }
        qsort(lat, (size_t)m, sizeof *lat, cmp_d);
        if (m)
            snprintf(line, sizeof line, "| %d | %d | %d | %.2f | %.2f | %.2f | %d | %d |\n", n,
                     shapes[i].sleep_ns, shapes[i].ncopy, lat[m / 2], lat[m * 9 / 10], lat[m - 1],
                     gave_up, late);
        else
            snprintf(line, sizeof line, "| %d | %d | %d | | | | %d | %d |\n", n, shapes[i].sleep_ns,
                     shapes[i].ncopy, gave_up, late);
        free(lat);
        bm_put(md, line);
    }
    return 0;
}

int main(int argc, char **argv)
{
    int n;
    FILE *md;
    char desc[256];
    const int st = bm_open("bench-launch", argc, argv, &n, &md, desc, sizeof desc);
    if (st >= 0) return st;
    const size_t smem = 115 * 1024;
    char line[512];
    snprintf(line, sizeof line,
             "# bench-launch, %s\n\n%d launches back to back (best of 3), one CTA of 256 threads "
             "an SM; the large kernel holds %zu KB of dynamic shared memory.\n\n| kernels | PDL | "
             "carveout | us a launch |\n|---|---|---|---|\n",
             desc, n, smem / 1024);
    bm_put(md, line);
    static const char *kinds[] = {"empty", "115 KB shared", "empty and 115 KB in turn"};
    static const int carves[2] = {-1, 100}; /* the driver's choice, the most shared memory */
    for (int pdl = 0; pdl <= 1; pdl++)
        for (int ci = 0; ci < 2; ci++)
            for (int k = LB_NOP; k <= LB_ALTERNATE; k++) {
                const int carve = carves[ci];
                double us = 0;
                char msg[256] = "";
                if (lb_chain(k, n, pdl, carve, smem, &us, msg)) {
                    fprintf(stderr, "bench-launch: %s\n", msg);
                    return 1;
                }
                snprintf(line, sizeof line, "| %s | %s | %s | %.2f |\n", kinds[k],
                         pdl ? "yes" : "no", carve < 0 ? "driver's" : "100% shared", us);
                bm_put(md, line);
            }
    if (handoff_table(md)) return 1;
    if (md) fclose(md);
    return 0;
}
