/* bench_ck.h - the GPU benches' CUDA call check: on failure, the call and CUDA's
 * message into msg[256] (a variable of the caller) and return -1. */
#ifndef SL_BENCH_CK_H
#define SL_BENCH_CK_H

#include <cuda_runtime.h>
#include <stdio.h>

#define CKB(call)                                                                                  \
    do {                                                                                           \
        cudaError_t rc_ = (call);                                                                  \
        if (rc_ != cudaSuccess) {                                                                  \
            snprintf(msg, 256, "%s: %s", #call, cudaGetErrorString(rc_));                          \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

#endif
