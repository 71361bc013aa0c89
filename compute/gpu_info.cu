/* gpu_info.cu - device discovery: how many GPUs, and what they are. */
#include <cuda_runtime.h>
#include <stdio.h>

#include "gpu.h"

extern "C" int sl_gpu_device_count(int *n, sl_err *err)
{
    if (!n) return sl_err_set(err, SL_EINVAL, "sl_gpu_device_count: n is NULL");
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc == cudaErrorNoDevice || rc == cudaErrorInsufficientDriver) {
        (void)cudaGetLastError();
        *n = 0;
        return 0;
    }
    if (rc != cudaSuccess) {
        *n = 0;
        return sl_err_set(err, SL_EIO, "cudaGetDeviceCount: %s", cudaGetErrorString(rc));
    }
    *n = count;
    return 0;
}

extern "C" int sl_gpu_describe(int dev, char *buf, unsigned long len, sl_err *err)
{
    cudaDeviceProp prop;
    cudaError_t rc = cudaGetDeviceProperties(&prop, dev);
    if (rc != cudaSuccess)
        return sl_err_set(err, SL_EIO, "cudaGetDeviceProperties(%d): %s", dev,
                          cudaGetErrorString(rc));
    snprintf(buf, len, "%s, sm_%d%d, %.1f GiB, %d SMs", prop.name, prop.major, prop.minor,
             (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), prop.multiProcessorCount);
    return 0;
}
