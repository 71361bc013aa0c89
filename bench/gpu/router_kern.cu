/* router_kern.cu - the kernels of bench-router: compute/'s prefetching router
 * (k_router_pf, one warp an expert: 32 lanes, router.h's order) and a sandbox form with
 * two warps an expert (64 lanes: lane l owns the runs of 8 elements r with r % 64 == l,
 * then a butterfly from off 32; router.c's order with 64 lanes, bench/gpu/router.c's
 * CPU twin), so that each lane's chain of fma is half as long. Both hold their row
 * share in registers before the wait for the previous kernel and write x's image for
 * the gate/up, as compute/ does; both record, per CTA, past its wait and its end. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_ck.h"
#include "moe_kern.cuh"
#include "router_bench.h"

namespace
{

constexpr int R64_C = 12; /* 16-byte chunks a lane: dim <= 512 R64_C */

/* Two warps an expert, 4 experts a CTA: warp 2x + h holds expert x's runs 64c + 32h +
 * lane; warp 2x + 1 hands its sums to warp 2x through shared memory (the butterfly's
 * off 32), which finishes as k_router_pf. stamps: [2 * CTA] past the wait, [2 * CTA +
 * 1] the end (thread 0, once warp 0 has its logit: after the barrier with its partner
 * warp, where k_router_pf's thread 0 waits for no other warp). */
__global__ void __launch_bounds__(256)
    k_router64(const uint16_t *__restrict__ w, const uint16_t *__restrict__ x, uint32_t n_expert,
               uint32_t dim, float temp, float *__restrict__ logits, uint8_t *__restrict__ ximg,
               unsigned long long *stamps)
{
    extern __shared__ int4 k_smem[];
    __shared__ float upper[4][32];
    float *xf = (float *)k_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = warp & 1;
    const uint32_t e = blockIdx.x * 4 + (warp >> 1), nrun = dim / 8;
    int4 v[R64_C];
    if (e < n_expert) {
        const int4 *row = (const int4 *)(w + (size_t)e * dim);
#pragma unroll
        for (int c = 0; c < R64_C; c++) {
            const uint32_t run = 64 * c + 32 * h + lane;
            if (run < nrun) v[c] = k_ld_stream(row + run);
        }
    }
    k_pdl_wait();
    k_pdl_go();
    if (stamps && threadIdx.x == 0) stamps[2 * blockIdx.x] = k_globaltimer();
    constexpr int XL = (32 * 2 * R64_C + 255) / 256; /* 16-byte loads of x a thread */
    int4 xv[XL];
#pragma unroll
    for (int l = 0; l < XL; l++) {
        const uint32_t i = threadIdx.x + l * 256;
        if (i < nrun) xv[l] = *(const int4 *)(x + 8 * i);
    }
#pragma unroll
    for (int l = 0; l < XL; l++) {
        const uint32_t i = threadIdx.x + l * 256;
        if (i >= nrun) break;
        const uint32_t u[4] = {(uint32_t)xv[l].x, (uint32_t)xv[l].y, (uint32_t)xv[l].z,
                               (uint32_t)xv[l].w};
        const float4 lo = make_float4(sl_emu_float(u[0] << 16), sl_emu_float(u[0] & 0xffff0000u),
                                      sl_emu_float(u[1] << 16), sl_emu_float(u[1] & 0xffff0000u));
        const float4 hi = make_float4(sl_emu_float(u[2] << 16), sl_emu_float(u[2] & 0xffff0000u),
                                      sl_emu_float(u[3] << 16), sl_emu_float(u[3] & 0xffff0000u));
        *(float4 *)(xf + 4 * i) = lo; /* k_xf_at */
        *(float4 *)(xf + dim / 2 + 4 * i) = hi;
    }
    __syncthreads();
    if (ximg) { /* k_quant_x_img's work, a block of 32 a warp, over the grid */
        int8_t *aq = (int8_t *)ximg;
        float *ad = (float *)(aq + dim + dim / 8);
        int *as = (int *)(ad + dim / 32);
        for (uint32_t b = blockIdx.x * 8 + warp; b < dim / 32; b += gridDim.x * 8)
            k_quant_block<true>(xf[k_xf_at(32 * b + lane, dim)], b, lane, aq, ad, as);
    }
    float acc = 0.0f;
    if (e < n_expert) {
#pragma unroll
        for (int c = 0; c < R64_C; c++) {
            const uint32_t run = 64 * c + 32 * h + lane;
            if (run >= nrun) break;
            const float4 lo = *(const float4 *)(xf + 4 * run),
                         hi = *(const float4 *)(xf + dim / 2 + 4 * run);
            const float a[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            const uint32_t u[4] = {(uint32_t)v[c].x, (uint32_t)v[c].y, (uint32_t)v[c].z,
                                   (uint32_t)v[c].w};
#pragma unroll
            for (int j = 0; j < 8; j++)
                acc = sl_emu_fma(
                    a[j], sl_emu_float(j & 1 ? u[j >> 1] & 0xffff0000u : u[j >> 1] << 16), acc);
        }
    }
    if (h) upper[warp >> 1][lane] = acc;
    __syncthreads();
    if (!h && e < n_expert) {
        acc = k_butterfly(sl_emu_add(acc, upper[warp >> 1][lane]), 16);
        if (temp != 1.0f) acc = sl_emu_div(acc, temp);
        if (lane == 0) logits[e] = acc;
    }
    if (stamps && threadIdx.x == 0) stamps[2 * blockIdx.x + 1] = k_globaltimer();
}

int cmp_u64(const void *a, const void *b)
{
    const unsigned long long x = *(const unsigned long long *)a, y = *(const unsigned long long *)b;
    return (x > y) - (x < y);
}

/* One launch of form f, stamping (compute/'s router: its rec slots 1 and 2 of
 * SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS c; the sandbox's [2c], [2c + 1]). */
cudaError_t launch(int f, const uint16_t *x, const uint16_t *w, uint32_t n_expert, uint32_t dim,
                   float *logits, uint8_t *ximg, unsigned long long *st)
{
    const uint32_t grid = (n_expert + 3) / 4;
    if (f == RB_LANES32)
        return k_launch(k_router_pf<4, 24>, grid, 128, sizeof(float) * dim, 0, true, w, x, n_expert,
                        dim, 1.0f, logits, ximg, st, k_rnorm{});
    return k_launch(k_router64, grid, 256, sizeof(float) * dim, 0, true, w, x, n_expert, dim, 1.0f,
                    logits, ximg, st);
}

} /* namespace */

/* rb_run's body; the device buffers are the caller's, freed by it. */
static int run(int f, const uint16_t *x, const uint16_t *w, uint32_t n_expert, uint32_t dim, int n,
               float *logits, double *us_chain, double *us_body, char *msg, uint16_t **dx,
               uint16_t **dw, float **dl, uint8_t **img, unsigned long long **st, cudaEvent_t *e0,
               cudaEvent_t *e1)
{
    if (dim == 0 || dim % 256 || dim > 256 * 24 || n_expert == 0 || n_expert > 1024 || n < 1) {
        snprintf(msg, 256, "rb_run: dim %u n_expert %u n %d", dim, n_expert, n);
        return -1;
    }
    const uint32_t grid = (n_expert + 3) / 4;
    CKB(cudaFuncSetAttribute(k_router_pf<4, 24>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)(sizeof(float) * dim)));
    CKB(cudaFuncSetAttribute(k_router64, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)(sizeof(float) * dim)));
    CKB(cudaMalloc(dx, sizeof **dx * dim));
    CKB(cudaMalloc(dw, sizeof **dw * dim * n_expert));
    CKB(cudaMemcpy(*dx, x, sizeof **dx * dim, cudaMemcpyHostToDevice));
    CKB(cudaMemcpy(*dw, w, sizeof **dw * dim * n_expert, cudaMemcpyHostToDevice));
    CKB(cudaMalloc(dl, sizeof(float) * n_expert));
    CKB(cudaMalloc(img, k_gu4_xbytes(dim)));
    const size_t nst = SL_GPU_RT_STAMPS > 2 * grid ? SL_GPU_RT_STAMPS : 2 * grid;
    CKB(cudaMalloc(st, sizeof **st * nst));
    CKB(cudaMemset(*st, 0, sizeof **st * nst));
    CKB(cudaEventCreate(e0));
    CKB(cudaEventCreate(e1));
    CKB(launch(f, *dx, *dw, n_expert, dim, *dl, *img, NULL));
    CKB(cudaDeviceSynchronize());
    CKB(cudaMemcpy(logits, *dl, sizeof(float) * n_expert, cudaMemcpyDeviceToHost));
    CKB(cudaEventRecord(*e0));
    for (int i = 0; i < n; i++)
        CKB(launch(f, *dx, *dw, n_expert, dim, *dl, *img, i == n - 1 ? *st : NULL));
    CKB(cudaEventRecord(*e1));
    CKB(cudaEventSynchronize(*e1));
    float ms = 0;
    CKB(cudaEventElapsedTime(&ms, *e0, *e1));
    *us_chain = ms * 1e3 / n;
    unsigned long long *h = (unsigned long long *)malloc(sizeof *h * nst);
    unsigned long long *d = (unsigned long long *)malloc(sizeof *d * grid);
    if (!h || !d) {
        free(h);
        free(d);
        snprintf(msg, 256, "rb_run: out of memory");
        return -1;
    }
    cudaError_t rc = cudaMemcpy(h, *st, sizeof *h * nst, cudaMemcpyDeviceToHost);
    if (rc == cudaSuccess) {
        for (uint32_t c = 0; c < grid; c++)
            d[c] = f == RB_LANES32 ? h[SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS * c + 2] -
                                         h[SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS * c + 1]
                                   : h[2 * c + 1] - h[2 * c];
        qsort(d, grid, sizeof *d, cmp_u64);
        *us_body = (double)d[grid / 2] / 1e3;
    }
    free(h);
    free(d);
    CKB(rc);
    return 0;
}

extern "C" int rb_run(int form, const uint16_t *x, const uint16_t *w, uint32_t n_expert,
                      uint32_t dim, int n, float *logits, double *us_chain, double *us_body,
                      char *msg)
{
    uint16_t *dx = NULL, *dw = NULL;
    float *dl = NULL;
    uint8_t *img = NULL;
    unsigned long long *st = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    const int rc = run(form, x, w, n_expert, dim, n, logits, us_chain, us_body, msg, &dx, &dw, &dl,
                       &img, &st, &e0, &e1);
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dl);
    cudaFree(img);
    cudaFree(st);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    return rc;
}
