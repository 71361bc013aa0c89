/* router.c - bench-router: compute/'s router (one warp an expert, router.h's 32-lane
 * order) against a sandbox form with two warps an expert (64 lanes: each lane's chain
 * of fma half as long, the sums meeting through shared memory), on the real shape
 * (384 experts x 5120, bf16): each form's logits against its CPU twin (router.c's for
 * the first, the same order with 64 lanes here for the second), bit for bit, and its
 * time back to back with programmatic dependent launch and from past its wait to its
 * end (the part of the layer's serial path it owns). The 64-lane form changes
 * router.h's documented order: it moves into compute/ (and router.c) only if it wins.
 *
 * usage: bench-router [-o FILE.md] [--n N (2000)]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_main.h"
#include "gpu.h"
#include "quant.h"
#include "router.h"
#include "router_bench.h"

#define DIM      5120
#define N_EXPERT 384

/* x . w in router.c's lane order with 64 lanes (runs of 8 elements, run r to lane
 * r % 64, each lane in increasing r, then the butterfly from off 32). */
static float dot64(const uint16_t *x, const uint16_t *w, uint32_t dim)
{
    float acc[64] = {0};
    for (uint32_t r = 0; r < dim / 8; r++)
        for (int j = 0; j < 8; j++)
            acc[r % 64] =
                fmaf(sl_bf16_to_f32(x[8 * r + j]), sl_bf16_to_f32(w[8 * r + j]), acc[r % 64]);
    for (int off = 32; off >= 1; off /= 2)
        for (int l = 0; l < off; l++) acc[l] = acc[l] + acc[l + off];
    return acc[0];
}

static uint64_t rng = 0x9e3779b97f4a7c15ULL;

static float urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1 << 24);
}

int main(int argc, char **argv)
{
    int n;
    FILE *md;
    char desc[256];
    const int st = bm_open("bench-router", argc, argv, &n, &md, desc, sizeof desc);
    if (st >= 0) return st;
    if (n < 1) {
        fprintf(stderr, "bench-router: --n %d (at least 1)\n", n);
        return 2;
    }
    sl_err err = {0};
    uint16_t *x = malloc(sizeof *x * DIM), *w = malloc(sizeof *w * DIM * N_EXPERT);
    float *want = malloc(sizeof *want * N_EXPERT), *got = malloc(sizeof *got * N_EXPERT);
    if (!x || !w || !want || !got) {
        fprintf(stderr, "bench-router: out of memory\n");
        return 1;
    }
    for (int i = 0; i < DIM; i++) x[i] = sl_f32_to_bf16(2.0f * urand() - 1.0f);
    for (int i = 0; i < DIM * N_EXPERT; i++) w[i] = sl_f32_to_bf16(0.04f * (urand() - 0.5f));
    char line[1024];
    snprintf(line, sizeof line,
             "# bench-router, %s\n\n%u experts x %u (bf16), x's image for the gate/up written "
             "too; %d launches back to back with PDL (us a launch), and the last launch's "
             "median CTA from past its wait to its end (%%globaltimer).\n\n"
             "| form | logits vs its CPU twin | us a router, back to back | past the wait to "
             "the end, us |\n|---|---|---|---|\n",
             desc, N_EXPERT, DIM, n);
    bm_put(md, line);
    static const char *names[2] = {"compute/'s: one warp an expert, 32 lanes (router.h)",
                                   "two warps an expert, 64 lanes (sandbox)"};
    int rc = 0;
    for (int f = RB_LANES32; f <= RB_LANES64; f++) {
        if (f == RB_LANES32) {
            if (sl_router_logits(x, w, N_EXPERT, DIM, 1.0f, want, &err)) {
                fprintf(stderr, "bench-router: %s\n", err.msg);
                return 1;
            }
        } else {
            for (int e = 0; e < N_EXPERT; e++) want[e] = dot64(x, w + (size_t)e * DIM, DIM);
        }
        double chain = 0, body = 0;
        char msg[256] = "";
        if (rb_run(f, x, w, N_EXPERT, DIM, n, got, &chain, &body, msg)) {
            fprintf(stderr, "bench-router: %s\n", msg);
            return 1;
        }
        int bad = 0;
        for (int e = 0; e < N_EXPERT; e++) bad += memcmp(&got[e], &want[e], sizeof *got) != 0;
        if (bad) rc = 1;
        snprintf(line, sizeof line, "| %s | %s | %.2f | %.2f |\n", names[f],
                 bad ? "DIFFERS" : "bit-exact", chain, body);
        if (bad)
            fprintf(stderr, "bench-router: %s: %d of %d logits differ from the CPU twin\n",
                    names[f], bad, N_EXPERT);
        bm_put(md, line);
    }
    if (md) fclose(md);
    free(x);
    free(w);
    free(want);
    free(got);
    return rc;
}
