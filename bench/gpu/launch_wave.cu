/* launch_wave.cu - bench-launch's first-wave kernel: every CTA of a grid that fills the
 * GPU queues a few bulk copies from device memory into its shared memory at the same
 * moment (as the device-table gate/up does once it has the selection's table), and
 * notes on %globaltimer how long its thread spent queueing them, when the first one
 * landed and when all had. What it shows: how the first bytes' wait and the queueing
 * thread's stall grow with the bytes every SM asks for at once. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_ck.h"
#include "launch_bench.h"
#include "moe_kern.cuh"

namespace
{

/* Thread 0 of each CTA: its ncopy barriers, then the grid's start (every CTA counted in
 * *arrive), then `first` copies of `bytes` from its own span of src (the rest once copy
 * 0 has landed; first == ncopy: all at once). out[4c..4c+3]: the start, then ns from it
 * to the end of the first queueing, to copy 0's landing and to the last landing. */
__global__ void k_wave(const uint8_t *src, int ncopy, uint32_t bytes, int first, unsigned *arrive,
                       unsigned long long *out)
{
    extern __shared__ int4 k_smem[];
    uint8_t *dst = (uint8_t *)k_smem;
    uint64_t *bar = (uint64_t *)(dst + (size_t)ncopy * bytes);
    if (threadIdx.x != 0) return;
    for (int k = 0; k < ncopy; k++) k_mbar_init(bar + k, 1);
    k_mbar_fence_init();
    atomicAdd(arrive, 1u);
    const unsigned long long w0 = k_globaltimer();
    while (*(volatile unsigned *)arrive < gridDim.x) /* a grid not all resident: a trap */
        if (k_globaltimer() - w0 > 2000000000ull) __trap();
    const uint8_t *p = src + (size_t)blockIdx.x * ncopy * bytes;
    auto queue = [&](int k) {
        k_mbar_expect(bar + k, bytes);
        k_bulk(dst + (size_t)k * bytes, p + (size_t)k * bytes, bytes, bar + k);
    };
    const unsigned long long t0 = k_globaltimer();
    for (int k = 0; k < first; k++) queue(k);
    const unsigned long long t1 = k_globaltimer();
    k_mbar_wait(bar, 0);
    const unsigned long long t2 = k_globaltimer();
    for (int k = first; k < ncopy; k++) queue(k);
    for (int k = 1; k < ncopy; k++) k_mbar_wait(bar + k, 0);
    const unsigned long long t3 = k_globaltimer();
    unsigned long long *o = out + 4 * (size_t)blockIdx.x;
    o[0] = t0;
    o[1] = t1 - t0;
    o[2] = t2 - t0;
    o[3] = t3 - t0;
}

} // namespace

/* lb_wave's body; the buffers are the caller's, freed by it. */
static int wave(int per_sm, int ncopy, uint32_t bytes, int first, int reps, size_t cap, double *q,
                double *f, double *a, double *gbps, int *ctas, char *msg, uint8_t **src,
                unsigned **arrive, unsigned long long **out)
{
    if (per_sm < 1 || per_sm > 2 || ncopy < 1 || ncopy > 16 || bytes % 16 || bytes == 0 ||
        first < 1 || first > ncopy || reps < 1) {
        snprintf(msg, 256, "lb_wave: per_sm %d ncopy %d bytes %u first %d reps %d", per_sm, ncopy,
                 bytes, first, reps);
        return -1;
    }
    int dev = 0, n_sm = 0;
    CKB(cudaGetDevice(&dev));
    CKB(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    const int grid = per_sm * n_sm;
    *ctas = grid;
    if ((size_t)reps * grid > cap) {
        snprintf(msg, 256, "lb_wave: %d launches of %d CTAs past %zu entries", reps, grid, cap);
        return -1;
    }
    const size_t smem = (size_t)ncopy * bytes + 8 * (size_t)ncopy;
    CKB(cudaFuncSetAttribute(k_wave, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int occ = 0;
    CKB(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k_wave, 32, smem));
    if (occ < per_sm) {
        snprintf(msg, 256, "lb_wave: %zu bytes of shared memory leave %d CTAs an SM, not %d", smem,
                 occ, per_sm);
        return -1;
    }
    size_t span = 0; /* a span a launch, 1 GiB of them in turn */
    int nspan = 0;
    if (bench_spans("lb_wave", (size_t)grid * ncopy * bytes, (size_t)1 << 30, src, &span, &nspan,
                    msg))
        return -1;
    CKB(cudaMalloc(arrive, sizeof **arrive));
    CKB(cudaMalloc(out, sizeof **out * 4 * (size_t)grid));
    unsigned long long *h = (unsigned long long *)malloc(sizeof *h * 4 * (size_t)grid);
    if (!h) {
        snprintf(msg, 256, "lb_wave: out of memory");
        return -1;
    }
    for (int r = -1; r < reps; r++) { /* r = -1: a warm-up launch, not kept */
        const size_t at = (size_t)((r + 1) % nspan) * span;
        cudaError_t rc = cudaMemset(*arrive, 0, sizeof **arrive);
        if (rc == cudaSuccess) {
            k_wave<<<grid, 32, smem>>>(*src + at, ncopy, bytes, first, *arrive, *out);
            rc = cudaGetLastError();
        }
        if (rc == cudaSuccess)
            rc = cudaMemcpy(h, *out, sizeof *h * 4 * (size_t)grid, cudaMemcpyDeviceToHost);
        if (rc != cudaSuccess) {
            free(h);
            snprintf(msg, 256, "k_wave: %s", cudaGetErrorString(rc));
            return -1;
        }
        if (r < 0) continue;
        unsigned long long t0 = ~0ull, t1 = 0;
        for (int c = 0; c < grid; c++) {
            const unsigned long long *o = h + 4 * (size_t)c;
            const size_t i = (size_t)r * grid + c;
            q[i] = (double)o[1] / 1e3;
            f[i] = (double)o[2] / 1e3;
            a[i] = (double)o[3] / 1e3;
            if (o[0] < t0) t0 = o[0];
            if (o[0] + o[3] > t1) t1 = o[0] + o[3];
        }
        /* the difference in integers first: ns since 1970 are past a double's 53 bits */
        gbps[r] = (double)grid * ncopy * bytes / (double)(long long)(t1 - t0);
    }
    free(h);
    return 0;
}

extern "C" int lb_wave(int per_sm, int ncopy, uint32_t bytes, int first, int reps, size_t cap,
                       double *q, double *f, double *a, double *gbps, int *ctas, char *msg)
{
    uint8_t *src = NULL;
    unsigned *arrive = NULL;
    unsigned long long *out = NULL;
    const int rc =
        wave(per_sm, ncopy, bytes, first, reps, cap, q, f, a, gbps, ctas, msg, &src, &arrive, &out);
    cudaFree(src);
    cudaFree(arrive);
    cudaFree(out);
    return rc;
}
