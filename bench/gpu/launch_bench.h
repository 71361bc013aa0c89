/* launch_bench.h - what bench/gpu/launch.c and its kernels (launch_kern.cu) share. */
#ifndef SL_LAUNCH_BENCH_H
#define SL_LAUNCH_BENCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { LB_NOP, LB_SMEM, LB_ALTERNATE };

/* Microseconds a launch (best of 3 runs of n launches back to back, one CTA of 256
 * threads an SM) of: empty kernels (LB_NOP), kernels holding smem bytes of dynamic
 * shared memory (LB_SMEM), or the two in turn (LB_ALTERNATE); pdl: programmatic
 * dependent launch; carve: the carveout preference of both (-1: the driver's). */
int lb_chain(int kind, int n, int pdl, int carve, size_t smem, double *us, char *msg);

#ifdef __cplusplus
}
#endif

#endif
