/* launch_kern.cu - the kernels of bench-launch: empty CTAs with and without a large
 * dynamic shared-memory allocation, launched back to back with or without
 * programmatic dependent launch (PDL), to measure what a launch costs on the GPU's
 * side and whether a change of L1 / shared-memory split between two kernels adds to it. */
#include <cuda_runtime.h>
#include <stdio.h>

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
