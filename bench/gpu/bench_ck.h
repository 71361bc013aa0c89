/* bench_ck.h - the GPU benches' CUDA call check (CKB: on failure, the call and CUDA's
 * message into msg[256], a variable of the caller, and return -1), and the device memory
 * of reads that L2 must not hold (bench_spans). */
#ifndef SL_BENCH_CK_H
#define SL_BENCH_CK_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#define CKB(call)                                                                                  \
    do {                                                                                           \
        cudaError_t rc_ = (call);                                                                  \
        if (rc_ != cudaSuccess) {                                                                  \
            snprintf(msg, 256, "%s: %s", #call, cudaGetErrorString(rc_));                          \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

/* `total` bytes of device memory at *src (the caller frees it), filled with ones, cut
 * into *nspan spans of launch_bytes rounded up to 4 KB: launch k reads span k % *nspan, so
 * that L2 never holds a launch's bytes. Fewer than two spans is an error named after who. */
static inline int bench_spans(const char *who, size_t launch_bytes, size_t total, uint8_t **src,
                              size_t *span, int *nspan, char *msg)
{
    *span = (launch_bytes + 4095) / 4096 * 4096;
    *nspan = (int)(total / *span);
    if (*nspan < 2) {
        snprintf(msg, 256, "%s: %zu bytes a launch", who, *span);
        return -1;
    }
    CKB(cudaMalloc(src, total));
    CKB(cudaMemset(*src, 1, total));
    return 0;
}

#endif
