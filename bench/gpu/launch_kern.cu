/* launch_kern.cu - the kernels of bench-launch: empty CTAs with and without a large
 * dynamic shared-memory allocation, launched back to back with or without
 * programmatic dependent launch (PDL), to measure what a launch costs on the GPU's
 * side and whether a change of L1 / shared-memory split between two kernels adds to it. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_ck.h"
#include "k_launch.cuh"
#include "launch_bench.h"

namespace
{

__device__ __forceinline__ void pdl_step(int pdl)
{
    if (pdl) {
        k_pdl_wait();
        k_pdl_go();
    }
}

/* Nothing but the PDL handshake (sink is never written: the value is impossible). */
__global__ void k_nop(int *sink, int pdl)
{
    pdl_step(pdl);
    if (threadIdx.x == 1024) *sink = 1;
}

/* The same, holding (and touching) a large dynamic shared-memory allocation. */
__global__ void k_smem(int *sink, int pdl)
{
    extern __shared__ int sm[];
    sm[threadIdx.x] = (int)threadIdx.x;
    pdl_step(pdl);
    __syncthreads();
    if (sm[(threadIdx.x + 1) % blockDim.x] < 0) *sink = 1;
}

__device__ __forceinline__ unsigned long long gtimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* lb_handoff's kernel: CTA 0 writes, the others poll (one warp each). tab holds
 * ncopy tables of 32 words; seen[c - 1] gets poller c's sight (0: it gave up),
 * seen[n_poll] the stores' time, seen[n_poll + c] poller c's start. */
__global__ void k_handoff(unsigned long long *tab, unsigned long long *seen, int n_poll, int words,
                          int sleep_ns, int ncopy, unsigned long long tag)
{
    const int lane = threadIdx.x;
    const unsigned long long t0 = gtimer();
    if (blockIdx.x == 0) {
        while (gtimer() - t0 < 4000) {
        }
        const unsigned long long ts = gtimer();
        if (lane < words)
            for (int q = 0; q < ncopy; q++)
                asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(tab + 32 * q + lane),
                             "l"(tag)
                             : "memory");
        if (lane == 0) seen[n_poll] = ts;
        return;
    }
    if (lane == 0) seen[n_poll + blockIdx.x] = t0;
    const unsigned long long *w = tab + 32 * ((blockIdx.x - 1) % ncopy);
    for (;;) {
        unsigned long long v = tag;
        if (lane < words)
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];"
                         : "=l"(v)
                         : "l"(w + lane)
                         : "memory");
        if (__all_sync(~0u, v == tag)) break;
        if (sleep_ns) __nanosleep(sleep_ns);
        if (__shfl_sync(~0u, (int)(gtimer() - t0 > 2000000ull), 0)) { /* lane 0 decides */
            if (lane == 0) seen[blockIdx.x - 1] = 0;
            return;
        }
    }
    if (lane == 0) seen[blockIdx.x - 1] = gtimer();
}

} /* namespace */

/* lb_chain's body; e0, e1 and sink are the caller's, freed by it. */
static int chain(int kind, int n, int pdl, int carve, size_t smem, double *us, char *msg,
                 cudaEvent_t *e0, cudaEvent_t *e1, int **sink)
{
    int dev = 0, n_sm = 0;
    CKB(cudaGetDevice(&dev));
    CKB(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    CKB(cudaFuncSetAttribute(k_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const cudaFuncAttribute a = cudaFuncAttributePreferredSharedMemoryCarveout;
    CKB(cudaFuncSetAttribute(k_nop, a, carve));
    CKB(cudaFuncSetAttribute(k_smem, a, carve));
    CKB(cudaMalloc(sink, 4));
    CKB(cudaEventCreate(e0));
    CKB(cudaEventCreate(e1));
    float best = 1e30f;
    for (int rep = 0; rep < 3; rep++) {
        CKB(cudaEventRecord(*e0));
        for (int i = 0; i < n; i++) {
            const bool big = kind == LB_SMEM || (kind == LB_ALTERNATE && (i & 1));
            CKB(k_launch(big ? k_smem : k_nop, (uint32_t)n_sm, 256, big ? smem : 0, 0, pdl != 0,
                         *sink, pdl));
        }
        CKB(cudaEventRecord(*e1));
        CKB(cudaEventSynchronize(*e1));
        float ms = 0;
        CKB(cudaEventElapsedTime(&ms, *e0, *e1));
        if (ms < best) best = ms;
    }
    *us = best * 1e3 / n;
    return 0;
}

extern "C" int lb_chain(int kind, int n, int pdl, int carve, size_t smem, double *us, char *msg)
{
    cudaEvent_t e0 = NULL, e1 = NULL;
    int *sink = NULL;
    const int rc = chain(kind, n, pdl, carve, smem, us, msg, &e0, &e1, &sink);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(sink);
    return rc;
}

/* lb_handoff's body; tab and seen are the caller's, freed by it. */
static int handoff(int n_poll, int words, int sleep_ns, int ncopy, int reps, double *lat, int *late,
                   char *msg, unsigned long long **tab, unsigned long long **seen)
{
    *late = 0;
    if (n_poll < 1 || words < 1 || words > 32 || ncopy < 1 || ncopy > 8 || reps < 1) {
        snprintf(msg, 256, "lb_handoff: n_poll %d words %d ncopy %d reps %d", n_poll, words, ncopy,
                 reps);
        return -1;
    }
    CKB(cudaMalloc(tab, 8 * 32 * 8));
    CKB(cudaMemset(*tab, 0, 8 * 32 * 8));
    const size_t ns = 2 * (size_t)n_poll + 1;
    CKB(cudaMalloc(seen, sizeof **seen * ns));
    unsigned long long *h = (unsigned long long *)malloc(sizeof *h * ns);
    if (!h) {
        snprintf(msg, 256, "lb_handoff: out of memory");
        return -1;
    }
    for (int r = 0; r < reps; r++) {
        k_handoff<<<1 + n_poll, 32>>>(*tab, *seen, n_poll, words, sleep_ns, ncopy,
                                      (unsigned long long)(r + 1) << 4);
        cudaError_t rc = cudaGetLastError();
        if (rc == cudaSuccess) rc = cudaMemcpy(h, *seen, sizeof *h * ns, cudaMemcpyDeviceToHost);
        if (rc != cudaSuccess) {
            free(h);
            snprintf(msg, 256, "k_handoff: %s", cudaGetErrorString(rc));
            return -1;
        }
        /* the difference in integers first: ns since 1970 are past a double's 53 bits */
        for (int c = 0; c < n_poll; c++) {
            lat[(size_t)r * n_poll + c] =
                h[c] ? (double)(long long)(h[c] - h[n_poll]) / 1e3 : NAN; /* 0: gave up */
            *late += h[n_poll + 1 + c] > h[n_poll];
        }
    }
    free(h);
    return 0;
}

extern "C" int lb_handoff(int n_poll, int words, int sleep_ns, int ncopy, int reps, double *lat,
                          int *late, char *msg)
{
    unsigned long long *tab = NULL, *seen = NULL;
    const int rc = handoff(n_poll, words, sleep_ns, ncopy, reps, lat, late, msg, &tab, &seen);
    cudaFree(tab);
    cudaFree(seen);
    return rc;
}
