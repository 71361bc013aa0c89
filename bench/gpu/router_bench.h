/* router_bench.h - what bench/gpu/router.c and its kernels (router_kern.cu) share. */
#ifndef SL_ROUTER_BENCH_H
#define SL_ROUTER_BENCH_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { RB_LANES32, RB_LANES64 }; /* compute/'s router (a warp an expert), two warps an expert */

/* One form's router over x [dim] and w [n_expert][dim] (bf16, host arrays, copied to the
 * device here): its logits into the host array logits [n_expert] (one launch, after a
 * sync), then n launches back to back on one stream with programmatic dependent launch
 * (each waits for the one before, as in the layer: the weight loads overlap it), us a
 * launch into *us_chain, and the median over the last launch's CTAs of its
 * %globaltimer from past its wait to its end into *us_body. x's image for the gate/up
 * is written too (both forms, as in compute/). Returns 0, or -1 with msg[256]. */
int rb_run(int form, const uint16_t *x, const uint16_t *w, uint32_t n_expert, uint32_t dim, int n,
           float *logits, double *us_chain, double *us_body, char *msg);

#ifdef __cplusplus
}
#endif

#endif
