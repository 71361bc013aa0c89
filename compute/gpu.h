/* gpu.h - the plain C face of sluice's CUDA code.
 *
 * Everything CUDA lives in the .cu files of compute/, behind this header; host code never sees a
 * CUDA type. Each entry checks its arguments and every CUDA call, and reports
 * failures through sl_err. No entry keeps global mutable state.
 */
#ifndef SL_GPU_H
#define SL_GPU_H

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices usable by this process; 0 (and success) when there is no
 * GPU or no driver, so that callers and tests can skip cleanly. */
int sl_gpu_device_count(int *n, sl_err *err);

/* One line describing device `dev` (name, compute capability, memory) into buf. */
int sl_gpu_describe(int dev, char *buf, unsigned long len, sl_err *err);

#ifdef __cplusplus
}
#endif

#endif
