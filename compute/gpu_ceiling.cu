/* gpu_ceiling.cu - what the GPU's memory paths can do: free memory, whether the GPU
 * shares the host's memory, and the read ceilings (HBM, host->device copy, zero-copy
 * reads of registered host memory) that benchmarks print their figures against. */
#include <cuda_runtime.h>
#include <stdio.h>

#include "gpu.h"

#define CHECK(call, label)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            rc = sl_err_set(err, SL_EIO, "%s: %s", label, cudaGetErrorString(e_));                 \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

extern "C" int sl_gpu_mem_info(int dev, sl_gpu_mem *out, sl_err *err)
{
    int rc = 0;
    cudaDeviceProp prop;
    size_t fr = 0, tot = 0;
    CHECK(cudaSetDevice(dev), "cudaSetDevice");
    CHECK(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    CHECK(cudaMemGetInfo(&fr, &tot), "cudaMemGetInfo");
    out->free_bytes = fr;
    out->total_bytes = tot;
    out->shares_host_memory = prop.integrated || prop.pageableMemoryAccessUsesHostPageTables;
done:
    return rc;
}

/* XORs n 16-byte words together with a grid-stride loop (the loads cannot be dropped,
 * and the result checks that every word was read: sl_gpu_ceiling_host's checksum);
 * one atomic per block. *sink must start at 0. */
__global__ void k_read_int4(const int4 *p, size_t n, unsigned *sink)
{
    __shared__ unsigned part[32];
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        int4 v = __ldcs(p + i);
        acc ^= (unsigned)(v.x ^ v.y ^ v.z ^ v.w);
    }
    for (int off = 16; off; off >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; w++) acc ^= part[w];
        atomicXor(sink, acc);
    }
}

/* Best of `reps` timed runs of a read kernel over n int4 words at p, bytes/s. */
static int time_read(const int4 *p, size_t n, unsigned *sink, int reps, double *best,
                     unsigned *checksum, sl_err *err)
{
    int rc = 0, sms = 0, dev = 0;
    cudaEvent_t a = NULL, b = NULL;
    CHECK(cudaGetDevice(&dev), "cudaGetDevice");
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
          "cudaDeviceGetAttribute");
    CHECK(cudaEventCreate(&a), "cudaEventCreate");
    CHECK(cudaEventCreate(&b), "cudaEventCreate");
    *best = 0;
    for (int r = 0; r < reps; r++) {
        CHECK(cudaMemset(sink, 0, sizeof *sink), "cudaMemset(sink)");
        CHECK(cudaEventRecord(a), "cudaEventRecord");
        k_read_int4<<<sms * 8, 512>>>(p, n, sink);
        CHECK(cudaGetLastError(), "k_read_int4");
        CHECK(cudaEventRecord(b), "cudaEventRecord");
        CHECK(cudaEventSynchronize(b), "cudaEventSynchronize");
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
        double v = (double)n * 16.0 / ((double)ms / 1e3);
        if (r > 0 && v > *best) *best = v; /* run 0 warms up */
    }
    if (checksum) CHECK(cudaMemcpy(checksum, sink, sizeof *sink, cudaMemcpyDeviceToHost), "sink");
done:
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    return rc;
}

extern "C" int sl_gpu_ceiling_hbm(int dev, size_t bytes, double *hbm, sl_err *err)
{
    int rc = 0;
    void *buf = NULL;
    unsigned *sink = NULL;
    CHECK(cudaSetDevice(dev), "cudaSetDevice");
    CHECK(cudaMalloc(&buf, bytes), "cudaMalloc(ceiling buffer)");
    CHECK(cudaMalloc(&sink, sizeof *sink), "cudaMalloc(sink)");
    CHECK(cudaMemset(buf, 1, bytes), "cudaMemset");
    rc = time_read((const int4 *)buf, bytes / 16, sink, 6, hbm, NULL, err);
done:
    cudaFree(buf);
    cudaFree(sink);
    return rc;
}

extern "C" int sl_gpu_ceiling_host(int dev, const void *host, size_t bytes, double *copy,
                                   double *zero_copy, unsigned *checksum, sl_err *err)
{
    int rc = 0;
    void *dst = NULL, *mapped = NULL;
    unsigned *sink = NULL;
    cudaEvent_t a = NULL, b = NULL;
    if (((uintptr_t)host & 15) || bytes < 16 || (bytes & 15))
        return sl_err_set(err, SL_EINVAL,
                          "sl_gpu_ceiling_host: host and bytes must be 16-byte aligned");
    CHECK(cudaSetDevice(dev), "cudaSetDevice");
    CHECK(cudaHostGetDevicePointer(&mapped, (void *)host, 0),
          "cudaHostGetDevicePointer (is the memory registered as mapped?)");
    CHECK(cudaMalloc(&dst, bytes), "cudaMalloc(copy target)");
    CHECK(cudaMalloc(&sink, sizeof *sink), "cudaMalloc(sink)");
    CHECK(cudaEventCreate(&a), "cudaEventCreate");
    CHECK(cudaEventCreate(&b), "cudaEventCreate");
    *copy = 0;
    for (int r = 0; r < 4; r++) {
        CHECK(cudaEventRecord(a), "cudaEventRecord");
        CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpyAsync");
        CHECK(cudaEventRecord(b), "cudaEventRecord");
        CHECK(cudaEventSynchronize(b), "cudaEventSynchronize");
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
        double v = (double)bytes / ((double)ms / 1e3);
        if (r > 0 && v > *copy) *copy = v;
    }
    rc = time_read((const int4 *)mapped, bytes / 16, sink, 4, zero_copy, checksum, err);
done:
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    cudaFree(dst);
    cudaFree(sink);
    return rc;
}
