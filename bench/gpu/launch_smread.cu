/* launch_smread.cu - bench-launch's per-SM read: one CTA on every SM reads its own span
 * of device memory, all SMs at once, with plain 16-byte loads (1024 threads) or with bulk
 * copies into a ring of shared memory (one thread, as the MoE kernels' stages are
 * queued), and notes on %globaltimer when it started and ended. What it shows: whether
 * the memory system serves every SM alike when all ask at once (the spread of the SMs'
 * ends within a launch), and whether the same SMs are the slow ones launch after launch
 * (so that a static order could give them less), for the per-SM bytes of the MoE
 * layer's kernels. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_ck.h"
#include "launch_bench.h"
#include "moe_kern.cuh"

namespace
{

/* Each CTA reads n16 16-byte words from src + blockIdx.x * n16, four loads a thread in
 * flight (streaming: the bytes are read once), folds them into one word so that the
 * loads are not dropped, and writes out[3c..3c+2]: its start, its end (after its
 * threads met), its SM. sink is written only if the fold hits a value the fill never
 * makes, so the loads cost no stores. */
__global__ void __launch_bounds__(1024)
    k_smread(const int4 *src, uint32_t n16, unsigned *sink, unsigned long long *out)
{
    __shared__ unsigned long long t0;
    if (threadIdx.x == 0) t0 = k_globaltimer();
    __syncthreads();
    const int4 *p = src + (size_t)blockIdx.x * n16;
    const uint32_t step = blockDim.x;
    unsigned fold = 0;
    for (uint32_t i = threadIdx.x; i < n16; i += 4 * step) {
        int4 v[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            v[k] = i + k * step < n16 ? __ldcs(p + i + k * step) : make_int4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < 4; k++) fold ^= (unsigned)(v[k].x ^ v[k].y ^ v[k].z ^ v[k].w);
    }
    if (fold == 0x9e3779b9u) *sink = fold;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long *o = out + 3 * (size_t)blockIdx.x;
        o[0] = t0;
        o[1] = k_globaltimer();
        o[2] = k_smid();
    }
}

enum { SR_STAGES = 6, SR_CHUNK = 32768 }; /* the bulk form's ring: 192 KB in flight an SM */
enum { SR_WARM = 3 };                     /* launches before the kept ones */

/* The same read as bulk copies (the MoE kernels' way): thread 0 keeps `stages` copies of
 * `chunk` bytes (the last one shorter; both multiples of 16) in flight into a ring of
 * shared memory, queueing each next one as a stage lands; out as k_smread's. */
__global__ void k_smread_bulk(const uint8_t *src, uint32_t bytes, uint32_t chunk, uint32_t stages,
                              unsigned long long *out)
{
    extern __shared__ int4 k_smem[];
    uint8_t *ring = (uint8_t *)k_smem;
    uint64_t *bar = (uint64_t *)(ring + (size_t)stages * chunk);
    if (threadIdx.x != 0) return;
    const unsigned long long t0 = k_globaltimer();
    for (uint32_t k = 0; k < stages; k++) k_mbar_init(bar + k, 1);
    k_mbar_fence_init();
    const uint8_t *p = src + (size_t)blockIdx.x * bytes;
    const uint32_t n = (bytes + chunk - 1) / chunk;
    auto queue = [&](uint32_t i) {
        const uint32_t len = bytes - i * chunk < chunk ? bytes - i * chunk : chunk;
        k_mbar_expect(bar + i % stages, len);
        k_bulk(ring + (size_t)(i % stages) * chunk, p + (size_t)i * chunk, len, bar + i % stages);
    };
    for (uint32_t i = 0; i < n && i < stages; i++) queue(i);
    for (uint32_t i = 0; i < n; i++) {
        k_mbar_wait(bar + i % stages, (i / stages) & 1);
        if (i + stages < n) queue(i + stages);
    }
    unsigned long long *o = out + 3 * (size_t)blockIdx.x;
    o[0] = t0;
    o[1] = k_globaltimer();
    o[2] = k_smid();
}

} // namespace

/* lb_smread's body; the buffers are the caller's, freed by it. */
static int smread(uint32_t bytes, int bulk, uint32_t chunk, uint32_t stages, int reps, size_t cap,
                  int *sm, double *end, double *dur, int *n_sm, char *msg, uint8_t **src,
                  unsigned **sink, unsigned long long **out)
{
    if (!chunk) chunk = SR_CHUNK;
    if (!stages) stages = SR_STAGES;
    if (bytes == 0 || bytes % 16 || reps < 1 || chunk % 16) {
        snprintf(msg, 256, "lb_smread: bytes %u chunk %u reps %d", bytes, chunk, reps);
        return -1;
    }
    int dev = 0, grid = 0, max_smem = 0;
    CKB(cudaGetDevice(&dev));
    CKB(cudaDeviceGetAttribute(&grid, cudaDevAttrMultiProcessorCount, dev));
    CKB(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    *n_sm = grid;
    if ((size_t)reps * grid > cap) {
        snprintf(msg, 256, "lb_smread: %d launches of %d CTAs past %zu entries", reps, grid, cap);
        return -1;
    }
    /* more than half an SM's shared memory a CTA: one CTA an SM, so one on every SM (and
     * room for the bulk form's ring and barriers) */
    const size_t ring = (size_t)stages * chunk + 8 * (size_t)stages;
    if (ring > (size_t)max_smem) {
        snprintf(msg, 256, "lb_smread: a ring of %zu bytes past %d", ring, max_smem);
        return -1;
    }
    const size_t half = (size_t)max_smem / 2 + 1024;
    const size_t smem = bulk && ring > half ? ring : half;
    const void *fn = bulk ? (const void *)k_smread_bulk : (const void *)k_smread;
    const int threads = bulk ? 32 : 1024;
    CKB(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int occ = 0;
    CKB(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, threads, smem));
    if (occ != 1) {
        snprintf(msg, 256, "lb_smread: %zu bytes of shared memory leave %d CTAs an SM, not 1", smem,
                 occ);
        return -1;
    }
    size_t span = 0; /* a span a launch, 2 GiB of them in turn */
    int nspan = 0;
    if (bench_spans("lb_smread", (size_t)grid * bytes, (size_t)2 << 30, src, &span, &nspan, msg))
        return -1;
    CKB(cudaMalloc(sink, sizeof **sink));
    CKB(cudaMalloc(out, sizeof **out * 3 * (size_t)grid));
    unsigned long long *h = (unsigned long long *)malloc(sizeof *h * 3 * (size_t)grid);
    if (!h) {
        snprintf(msg, 256, "lb_smread: out of memory");
        return -1;
    }
    for (int r = -SR_WARM; r < reps; r++) { /* r < 0: warm-up launches, not kept */
        const size_t at = (size_t)((r + SR_WARM) % nspan) * span;
        if (bulk)
            k_smread_bulk<<<grid, threads, smem>>>(*src + at, bytes, chunk, stages, *out);
        else
            k_smread<<<grid, threads, smem>>>((const int4 *)(*src + at), bytes / 16, *sink, *out);
        cudaError_t rc = cudaGetLastError();
        if (rc == cudaSuccess)
            rc = cudaMemcpy(h, *out, sizeof *h * 3 * (size_t)grid, cudaMemcpyDeviceToHost);
        if (rc != cudaSuccess) {
            free(h);
            snprintf(msg, 256, "k_smread: %s", cudaGetErrorString(rc));
            return -1;
        }
        if (r < 0) continue;
        unsigned long long t0 = ~0ull;
        for (int c = 0; c < grid; c++)
            if (h[3 * (size_t)c] < t0) t0 = h[3 * (size_t)c];
        for (int c = 0; c < grid; c++) {
            const unsigned long long *o = h + 3 * (size_t)c;
            const size_t i = (size_t)r * grid + c;
            /* differences in integers first: ns since 1970 are past a double's 53 bits */
            end[i] = (double)(long long)(o[1] - t0) / 1e3;
            dur[i] = (double)(long long)(o[1] - o[0]) / 1e3;
            sm[i] = (int)o[2];
        }
    }
    free(h);
    return 0;
}

extern "C" int lb_smread(uint32_t bytes, int bulk, uint32_t chunk, uint32_t stages, int reps,
                         size_t cap, int *sm, double *end, double *dur, int *n_sm, char *msg)
{
    uint8_t *src = NULL;
    unsigned *sink = NULL;
    unsigned long long *out = NULL;
    const int rc =
        smread(bytes, bulk, chunk, stages, reps, cap, sm, end, dur, n_sm, msg, &src, &sink, &out);
    cudaFree(src);
    cudaFree(sink);
    cudaFree(out);
    return rc;
}
