/* k_launch.cuh - programmatic dependent launch (PDL): the device side's wait and go,
 * and the host side's launch with or without it. Shared by compute/'s kernels and the
 * GPU benches; nothing here has external linkage. */
#ifndef SL_K_LAUNCH_CUH
#define SL_K_LAUNCH_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include <utility>

namespace
{

/* Programmatic dependent launch: wait for the previous kernel of the stream (and its
 * memory); let the next one start its prologue. Both are no-ops without PDL. */
__device__ __forceinline__ void k_pdl_wait()
{
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void k_pdl_go()
{
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

/* Launches kern<<<grid, block, smem, st>>>(args...), with programmatic stream
 * serialization when pdl (the kernel then starts while the previous one drains and
 * must call k_pdl_wait before touching what that one wrote). */
template <typename... P, typename... A>
inline cudaError_t k_launch(void (*kern)(P...), uint32_t grid, uint32_t block, size_t smem,
                            cudaStream_t st, bool pdl, A &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, std::forward<A>(args)...);
}

} /* namespace */

#endif
