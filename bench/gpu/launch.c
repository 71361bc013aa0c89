/* launch.c - bench-launch: what a kernel launch costs on the GPU's side, back to back
 * on one stream, with and without programmatic dependent launch, and whether kernels
 * that need different L1 / shared-memory splits cost more in turn than alike ones
 * (the MoE chain alternates small kernels and ~115 KB bulk-copy kernels); then how
 * long a table of tagged words takes from its writer to many polling CTAs (the
 * selection's handoff to the gate/up's 264 CTAs, lb_handoff); then the first wave of
 * bulk copies when every CTA asks for its first stages at once (lb_wave: the wait for
 * the first bytes and the queueing thread's stall, by the bytes asked); then each SM's
 * share of a read by every SM at once, by plain loads or bulk copies (lb_smread: how
 * far apart the SMs end, and whether the same SMs are slow launch after launch); then
 * the bulk copies' read rate by their size and the bytes an SM keeps in flight, and by
 * the bytes each SM reads (session 37).
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

/* p10, median, p90 and max of v[n] (sorted here). */
static void quantiles(double *v, size_t n, double out[4])
{
    qsort(v, n, sizeof *v, cmp_d);
    out[0] = v[n / 10], out[1] = v[n / 2], out[2] = v[n * 9 / 10], out[3] = v[n - 1];
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
        double lq[4];
        if (m) {
            quantiles(lat, (size_t)m, lq);
            snprintf(line, sizeof line, "| %d | %d | %d | %.2f | %.2f | %.2f | %d | %d |\n", n,
                     shapes[i].sleep_ns, shapes[i].ncopy, lq[1], lq[2], lq[3], gave_up, late);
        } else
            snprintf(line, sizeof line, "| %d | %d | %d | | | | %d | %d |\n", n, shapes[i].sleep_ns,
                     shapes[i].ncopy, gave_up, late);
        free(lat);
        bm_put(md, line);
    }
    return 0;
}

/* The first wave: every CTA queueing its bulk copies at one moment (lb_wave), for a
 * few shapes around the device-table gate/up's (2 CTAs an SM, 4 stages of two 13,440-byte
 * copies: 8 rows of gate and 8 of up at dim 5120). */
static int wave_table(FILE *md)
{
    enum { REPS = 20 };
    static const struct {
        int per_sm, ncopy, first;
        uint32_t bytes;
    } shapes[] = {{2, 1, 1, 13440},  {2, 2, 2, 13440}, {2, 4, 4, 13440},  {2, 8, 8, 13440},
                  {2, 8, 2, 13440},  {1, 8, 8, 13440}, {1, 16, 16, 6720}, {2, 2, 2, 53760},
                  {2, 16, 16, 6720}, {2, 16, 4, 6720}};
    char line[512];
    snprintf(line, sizeof line,
             "\nThe first wave: every CTA's thread 0 queues bulk copies from device memory "
             "(bytes L2 does not hold) at one moment, `first` of them at once and the rest "
             "once its first copy landed; %d launches, us from each CTA's start, p10 / median "
             "/ p90 / max over CTAs and launches; GB/s: a launch's bytes over its first start "
             "to its last landing (median launch):\n\n| CTAs | copies x KB (first) | MB asked | "
             "queueing | first copy landed | all landed | GB/s |\n|---|---|---|---|---|---|---|\n",
             REPS);
    bm_put(md, line);
    const size_t cap = (size_t)REPS * 1024;
    double *q = malloc(sizeof *q * cap), *f = malloc(sizeof *f * cap), *a = malloc(sizeof *a * cap),
           gb[REPS];
    int rc = !q || !f || !a;
    if (rc) fprintf(stderr, "bench-launch: out of memory\n");
    for (size_t i = 0; !rc && i < sizeof shapes / sizeof *shapes; i++) {
        char msg[256] = "";
        int ctas = 0;
        if (lb_wave(shapes[i].per_sm, shapes[i].ncopy, shapes[i].bytes, shapes[i].first, REPS, cap,
                    q, f, a, gb, &ctas, msg)) {
            fprintf(stderr, "bench-launch: %s\n", msg);
            rc = 1;
            break;
        }
        const size_t n = (size_t)REPS * ctas;
        double qs[4], fs[4], as[4], gs[4];
        quantiles(q, n, qs);
        quantiles(f, n, fs);
        quantiles(a, n, as);
        quantiles(gb, REPS, gs);
        snprintf(line, sizeof line,
                 "| %d | %d x %.1f (%d) | %.1f | %.2f / %.2f / %.2f / %.2f | %.2f / %.2f / %.2f / "
                 "%.2f | %.2f / %.2f / %.2f / %.2f | %.0f |\n",
                 ctas, shapes[i].ncopy, shapes[i].bytes / 1024.0, shapes[i].first,
                 (double)ctas * shapes[i].ncopy * shapes[i].bytes / 1e6, qs[0], qs[1], qs[2], qs[3],
                 fs[0], fs[1], fs[2], fs[3], as[0], as[1], as[2], as[3], gs[1]);
        bm_put(md, line);
    }
    free(q);
    free(f);
    free(a);
    return rc;
}

/* Ranks of v[n] into r (0 = the least; ties in index order). */
static void ranks(const double *v, int n, double *r, int *idx)
{
    for (int i = 0; i < n; i++) idx[i] = i;
    for (int i = 1; i < n; i++) { /* insertion sort of the indexes by value: n is ~132 */
        const int k = idx[i];
        int j = i - 1;
        for (; j >= 0 && v[idx[j]] > v[k]; j--) idx[j + 1] = idx[j];
        idx[j + 1] = k;
    }
    for (int i = 0; i < n; i++) r[idx[i]] = i;
}

/* Spearman's rank correlation of a[n] and b[n] (the Pearson correlation of their ranks). */
static double spearman(const double *a, const double *b, int n, double *ra, double *rb, int *idx)
{
    ranks(a, n, ra, idx);
    ranks(b, n, rb, idx);
    const double m = (n - 1) / 2.0;
    double sab = 0, saa = 0, sbb = 0;
    for (int i = 0; i < n; i++) {
        sab += (ra[i] - m) * (rb[i] - m);
        saa += (ra[i] - m) * (ra[i] - m);
        sbb += (rb[i] - m) * (rb[i] - m);
    }
    return saa > 0 && sbb > 0 ? sab / sqrt(saa * sbb) : 0;
}

/* Each SM's share of a read by every SM at once (lb_smread: plain loads, then bulk
 * copies as the MoE kernels' stages are read), for the per-SM
 * bytes of one token's 6-expert gate/up (352 KB), of the layer's 7-expert gate/up (408
 * KB) and a larger read: the SMs' ends within a launch, and the rank correlation of the
 * SMs' read times between every two launches (near 0: which SMs are slow changes from
 * launch to launch; near 1: the same SMs are slow). */
static int smread_table(FILE *md)
{
    enum { REPS = 40, NS = 3 };
    static const uint32_t sizes[NS] = {360448, 417792, 2097152};
    char line[1024];
    snprintf(line, sizeof line,
             "\nEach SM's share of a read by every SM at once: one CTA on every SM reads its own "
             "span (bytes L2 does not hold) with plain 16-byte loads by 1024 threads, or with "
             "bulk copies by one thread, six 32 KB stages in flight; %d launches, us on "
             "%%globaltimer. The SMs' read time (own start to end), p10 / median / p90 / max "
             "over SMs and launches; the median launch's median and last SM end after its first "
             "start; GB/s: the launch's bytes over its last end (median launch); the rank "
             "correlation of the SMs' read times between two launches, median and p90 over every "
             "pair:\n\n| read | KB an SM | MB a launch | SM read time | median SM end | last SM "
             "end | GB/s | same SMs slow? (median / p90) |\n|---|---|---|---|---|---|---|---|\n",
             REPS);
    bm_put(md, line);
    const size_t cap = (size_t)REPS * 1024;
    int *sm = malloc(sizeof *sm * cap), *idx = malloc(sizeof *idx * 1024);
    double *end = malloc(sizeof *end * cap), *dur = malloc(sizeof *dur * cap);
    double *by = malloc(sizeof *by * cap), *tmp = malloc(sizeof *tmp * cap);
    double *ra = malloc(sizeof *ra * 1024), *rb = malloc(sizeof *rb * 1024);
    const size_t npair = (size_t)REPS * (REPS - 1) / 2;
    double *rho = malloc(sizeof *rho * npair);
    int rc = !sm || !idx || !end || !dur || !by || !tmp || !ra || !rb || !rho;
    if (rc) fprintf(stderr, "bench-launch: out of memory\n");
    for (size_t s = 0; !rc && s < 2 * NS; s++) { /* plain loads, then bulk copies */
        char msg[256] = "";
        int n = 0;
        if (lb_smread(sizes[s % NS], s >= NS, 0, 0, REPS, cap, sm, end, dur, &n, msg)) {
            fprintf(stderr, "bench-launch: %s\n", msg);
            rc = 1;
            break;
        }
        /* by[r * n + k]: launch r's read time of SM k (one CTA on every SM: a CTA on an SM
         * out of range or on one already seen in its launch is an error) */
        for (size_t i = 0; i < (size_t)REPS * n; i++) by[i] = -1;
        for (size_t i = 0; i < (size_t)REPS * n; i++) {
            const int k = sm[i];
            if (k < 0 || k >= n || by[i / n * n + k] >= 0) {
                fprintf(stderr,
                        "bench-launch: lb_smread: launch %zu: SM %d of %d twice or out of range\n",
                        i / n, k, n);
                rc = 1;
                break;
            }
            by[i / n * n + k] = dur[i];
        }
        if (rc) break;
        size_t m = 0;
        for (int a = 0; a < REPS; a++)
            for (int b = a + 1; b < REPS; b++)
                rho[m++] = spearman(by + (size_t)a * n, by + (size_t)b * n, n, ra, rb, idx);
        double med_end[REPS], last_end[REPS], gb[REPS], dq[4], mq[4], lq[4], gq[4], rq[4];
        for (int r = 0; r < REPS; r++) {
            memcpy(tmp, end + (size_t)r * n, sizeof *tmp * n);
            double q[4];
            quantiles(tmp, (size_t)n, q);
            med_end[r] = q[1];
            last_end[r] = q[3];
            gb[r] = (double)n * sizes[s % NS] / (q[3] * 1e3);
        }
        memcpy(tmp, dur, sizeof *tmp * (size_t)REPS * n);
        quantiles(tmp, (size_t)REPS * n, dq);
        quantiles(med_end, REPS, mq);
        quantiles(last_end, REPS, lq);
        quantiles(gb, REPS, gq);
        quantiles(rho, npair, rq);
        snprintf(
            line, sizeof line,
            "| %s | %.0f | %.1f | %.2f / %.2f / %.2f / %.2f | %.2f | %.2f | %.0f | %.2f / %.2f "
            "|\n",
            s >= NS ? "bulk copies" : "loads", sizes[s % NS] / 1024.0,
            (double)n * sizes[s % NS] / 1e6, dq[0], dq[1], dq[2], dq[3], mq[1], lq[1], gq[1], rq[1],
            rq[2]);
        bm_put(md, line);
    }
    free(sm);
    free(idx);
    free(end);
    free(dur);
    free(by);
    free(tmp);
    free(ra);
    free(rb);
    free(rho);
    return rc;
}

enum { BR_REPS = 12 }; /* launches a cell of the bulk-copy rate tables */

/* *gbps: the median over BR_REPS launches of lb_smread's bulk form (every SM reads `bytes`
 * by copies of `chunk`, `stages` in flight) of every SM's bytes over the last SM's end. */
static int bulk_rate(uint32_t bytes, uint32_t chunk, uint32_t stages, double *gbps)
{
    const size_t cap = (size_t)BR_REPS * 1024;
    int *sm = malloc(sizeof *sm * cap), n = 0, rc = 0;
    double *end = malloc(sizeof *end * cap), *dur = malloc(sizeof *dur * cap);
    char msg[256] = "";
    if (!sm || !end || !dur) {
        fprintf(stderr, "bench-launch: out of memory\n");
        rc = 1;
    } else if (lb_smread(bytes, 1, chunk, stages, BR_REPS, cap, sm, end, dur, &n, msg)) {
        fprintf(stderr, "bench-launch: %s\n", msg);
        rc = 1;
    } else {
        double gb[BR_REPS], q[4];
        for (int r = 0; r < BR_REPS; r++) {
            double last = 0;
            for (int k = 0; k < n; k++)
                if (end[(size_t)r * n + k] > last) last = end[(size_t)r * n + k];
            gb[r] = last > 0 ? (double)n * bytes / (last * 1e3) : 0;
        }
        quantiles(gb, BR_REPS, q);
        *gbps = q[1];
    }
    free(sm);
    free(end);
    free(dur);
    return rc;
}

/* The read rate of bulk copies by their size and the bytes each SM keeps in flight: one
 * CTA on every SM reads 420 KB (the layer's gate/up on an SM of 16 units of 26.9 KB) of
 * its own span, copies of 2688 bytes (a unit's gate or up part of 4 blocks of 8 rows) to
 * 52.5 KB (two units), 53-210 KB in flight (as many whole copies as fit). What it shows:
 * whether small copies or more bytes in flight cost read rate by themselves. */
static int bulkrate_table(FILE *md)
{
    enum { NC = 7, NF = 4 };
    static const uint32_t chunks[NC] = {2688, 5376, 13440, 16384, 26880, 32768, 53760};
    static const uint32_t flight[NF] = {53760, 107520, 161280, 215040};
    const uint32_t bytes = 16 * 26880;
    char line[1024];
    snprintf(line, sizeof line,
             "\nBulk-copy read rate by copy size and bytes in flight an SM: one CTA on every SM "
             "reads %u KB of its own span (bytes L2 does not hold) by copies of one size, a "
             "fixed count of them in flight (one thread queues the next as one lands); GB/s of "
             "the median of %d launches (every SM's bytes over the last SM's end):\n\n| copy "
             "bytes | 53 KB in flight | 105 KB | 158 KB | 210 KB |\n|---|---|---|---|---|\n",
             bytes / 1024, BR_REPS);
    bm_put(md, line);
    for (int c = 0; c < NC; c++) {
        int at = snprintf(line, sizeof line, "| %u |", chunks[c]);
        for (int f = 0; f < NF; f++) {
            double gb = 0;
            if (chunks[c] > flight[f]) { /* not one copy in flight */
                at += snprintf(line + at, sizeof line - (size_t)at, " - |");
                continue;
            }
            if (bulk_rate(bytes, chunks[c], flight[f] / chunks[c], &gb)) return 1;
            at += snprintf(line + at, sizeof line - (size_t)at, " %.0f |", gb);
        }
        snprintf(line + at, sizeof line - (size_t)at, "\n");
        bm_put(md, line);
    }
    return 0;
}

/* The same read rate by the bytes an SM reads, for two copy sizes: each SM's span starts
 * that many bytes after the one before, so this also moves where the SMs' reads fall in
 * the memory's address interleave at each moment. */
static int stride_table(FILE *md)
{
    enum { NB = 8 };
    static const uint32_t per_sm[NB] = {360448, 393216, 401408, 409600,
                                        417792, 425984, 430080, 524288};
    char line[1024];
    snprintf(line, sizeof line,
             "\nThe same by the bytes each SM reads (its span's start is that far from the one "
             "before), 32 KB copies 6 in flight and 13440-byte copies 16 in flight; GB/s of the "
             "median of %d launches:\n\n| KB an SM | 4 KB pages | 32768 x 6 | 13440 x 16 |\n"
             "|---|---|---|---|\n",
             BR_REPS);
    bm_put(md, line);
    for (int b = 0; b < NB; b++) {
        double g32 = 0, g13 = 0;
        if (bulk_rate(per_sm[b], 32768, 6, &g32) || bulk_rate(per_sm[b], 13440, 16, &g13)) return 1;
        snprintf(line, sizeof line, "| %u | %u | %.0f | %.0f |\n", per_sm[b] / 1024,
                 per_sm[b] / 4096, g32, g13);
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
    if (handoff_table(md) || wave_table(md) || smread_table(md) || bulkrate_table(md) ||
        stride_table(md))
        return 1;
    if (md) fclose(md);
    return 0;
}
