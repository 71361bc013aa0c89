/* launch_bench.h - what bench/gpu/launch.c and its kernels (launch_kern.cu,
 * launch_wave.cu) share. */
#ifndef SL_LAUNCH_BENCH_H
#define SL_LAUNCH_BENCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { LB_NOP, LB_SMEM, LB_ALTERNATE };

/* Microseconds a launch (best of 3 runs of n launches back to back, one CTA of 256
 * threads an SM) of: empty kernels (LB_NOP), kernels holding smem bytes of dynamic
 * shared memory (LB_SMEM), or the two in turn (LB_ALTERNATE); pdl: programmatic
 * dependent launch; carve: the carveout preference of both (-1: the driver's). */
int lb_chain(int kind, int n, int pdl, int carve, size_t smem, double *us, char *msg);

/* How long a table of tagged words takes from one CTA's stores to n_poll polling CTAs
 * (the selection's handoff to the gate/up, compute/moe_kern.cuh's sl_kttab): one
 * writer CTA waits 4 us from its start (the pollers are polling by then), notes
 * %globaltimer and stores `words` 64-bit words, a lane each, tagged; each poller's warp
 * loads the words, a lane each, until all carry the tag, with sleep_ns of __nanosleep
 * between rounds (0: none), and notes %globaltimer. ncopy > 1: the writer stores the
 * table ncopy times, 256 bytes apart, and poller c polls copy c % ncopy. reps launches;
 * lat[reps * n_poll] gets each poller's time from the stores to its sight, in us (the
 * SMs' clocks may differ by a step, so a quick sight can read slightly negative), or
 * NaN where it gave up after 2 ms; *late counts the pollers that started only after
 * the stores (their time is their start's delay, not the handoff's). */
int lb_handoff(int n_poll, int words, int sleep_ns, int ncopy, int reps, double *lat, int *late,
               char *msg);

/* The first wave of a grid of per_sm CTAs an SM (1 or 2; *ctas gets the count), each
 * thread 0 queueing ncopy bulk copies of `bytes` (a multiple of 16) from its own span of
 * device memory into its shared memory at one moment (all CTAs started first): `first`
 * of them at once, the rest once copy 0 has landed (first == ncopy: all at once). Each
 * of reps launches reads bytes L2 does not hold. q, f, a [reps * ctas, at most cap]:
 * each CTA's us from its start to the end of its first queueing, to copy 0's landing, to
 * its last landing; gbps[reps]: each launch's bytes over its first start to last
 * landing, GB/s. */
int lb_wave(int per_sm, int ncopy, uint32_t bytes, int first, int reps, size_t cap, double *q,
            double *f, double *a, double *gbps, int *ctas, char *msg);

/* Each SM's share of a read by every SM at once (launch_smread.cu): one CTA on every SM
 * reads `bytes` (a multiple of 16) of its own span (bytes L2 does not hold) with 16-byte
 * loads by 1024 threads (bulk 0) or with bulk copies of `chunk` bytes (a multiple of 16),
 * `stages` of them in flight (bulk 1; 0, 0: six of 32 KB); reps launches. For launch r
 * and CTA c, at [r * *n_sm + c] of the caller's arrays (cap entries): sm, its SM; end,
 * us from the launch's first start to its end; dur, us from its own start to its end. */
int lb_smread(uint32_t bytes, int bulk, uint32_t chunk, uint32_t stages, int reps, size_t cap,
              int *sm, double *end, double *dur, int *n_sm, char *msg);

#ifdef __cplusplus
}
#endif

#endif
