/* moe.cu - the C entries of the MoE kernels: context, memory helpers, router, shared
 * expert and routed experts of one token (DESIGN.md "One decode step").
 *
 * The context owns two streams (main; side, for the shared expert), the events that
 * join them, and all scratch, sized at open: a layer allocates nothing. Kernels come
 * from moe_kern.cuh; the configuration below (warps per CTA, prefetch) is the one
 * that won in bench/gpu/moe (bench/results/2026-11-29-moe.md). Every CUDA call and
 * every launch is checked with a label.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"
#include "moe_kern.cuh"

/* The bench's winner (bench/results/2026-11-29-moe.md, run 3: down T1 beat T2/T4;
 * prefetch, occupancy and the fused q8_1 of h made no difference to gate/up). Run 5's
 * k_gateup4_q2_k (bit-exact, 31.4 vs 36.9 us from HBM) is not shipped: it reads
 * mapped host memory at 0.64 of the zero-copy ceiling against 0.96 here. */
#define GU_NW   8    /* warps per CTA, gate/up */
#define GU_PF   true /* prefetch the next row pair */
#define GU_MINB 1    /* __launch_bounds__ min CTAs per SM, gate/up */
#define BF_NW   8    /* BF16 shared expert and router */
#define DN_T    1    /* 4-row tiles per CTA, down */

struct sl_gpu_ctx {
    int dev, n_sm;
    sl_moe_shape shape;
    int sh_bf16;          /* 1: the shared expert is BF16 */
    int gu_maxv, dn_maxv; /* register chunks per lane of one step (4|8, 8|16) */
    int gu_occ, dn_occ;   /* CTAs per SM of the two kernels */
    cudaStream_t main, side;
    cudaEvent_t ev_in, ev_sh;
    int shared_pending; /* the side stream has a shared output for the next routed call */
    uint32_t n_last;    /* experts of the last routed call (for peek) */
    sl_kscratch rs, ss; /* routed [SL_GPU_MAX_USED] and shared [1] scratch */
    float *y_sh;        /* [dim] the shared expert's output */
    float *logits_dev;  /* [n_expert] */
    float *logits_host; /* [n_expert] pinned */
};

#define CK(call, label)                                                                            \
    do {                                                                                           \
        cudaError_t rc_ = (call);                                                                  \
        if (rc_ != cudaSuccess)                                                                    \
            return sl_err_set(err, SL_EIO, "%s: %s", label, cudaGetErrorString(rc_));              \
    } while (0)

#define CK_LAUNCH(label) CK(cudaGetLastError(), label)

static int check_ptr(const void *p, const char *what, sl_err *err)
{
    if (!p || ((uintptr_t)p & 15))
        return sl_err_set(err, SL_EINVAL, "%s: %p is NULL or not 16-byte aligned", what, p);
    return 0;
}

/* ---- launchers, one per kernel family; they pick the register-chunk count ---- */

/* Gate/up + SwiGLU of the table's experts, then the q8_1 of h. */
static cudaError_t launch_gateup(int maxv, int occ, int n_sm, const sl_ktab &tab, const uint16_t *x,
                                 uint32_t dim, uint32_t inter, float limit, const sl_kscratch &s,
                                 cudaStream_t st)
{
    const uint32_t units = (uint32_t)tab.n * inter;
    uint32_t grid = (units + GU_NW - 1) / GU_NW;
    if (grid > (uint32_t)(occ * n_sm)) grid = (uint32_t)(occ * n_sm);
    const size_t smem = k_gateup_smem(dim, GU_NW, maxv);
    if (maxv == 4)
        k_gateup_q2_k<GU_NW, 4, GU_PF, false, GU_MINB>
            <<<grid, GU_NW * 32, smem, st>>>(tab, x, dim, inter, limit, s);
    else
        k_gateup_q2_k<GU_NW, 8, GU_PF, false, GU_MINB>
            <<<grid, GU_NW * 32, smem, st>>>(tab, x, dim, inter, limit, s);
    cudaError_t rc = cudaGetLastError();
    if (rc != cudaSuccess) return rc;
    const uint32_t groups = units / 32;
    k_quant_h<<<(groups + 7) / 8, 256, 0, st>>>(s, groups);
    return cudaGetLastError();
}

/* Down of the table's experts and their fixed-order sum (+ extra). */
static cudaError_t launch_down(int maxv, const sl_ktab &tab, const int8_t *hq, const float *hd,
                               uint32_t dim, uint32_t inter, const float *extra, float *out_f32,
                               uint16_t *out, cudaStream_t st)
{
    const size_t smem = k_down2_smem(tab.n, maxv);
    const uint32_t grid = (dim / 4 + DN_T - 1) / DN_T;
    if (maxv == 8)
        k_down2_q3_k<8, DN_T>
            <<<grid, 32 * tab.n, smem, st>>>(tab, hq, hd, dim, inter, extra, out_f32, out);
    else
        k_down2_q3_k<16, DN_T>
            <<<grid, 32 * tab.n, smem, st>>>(tab, hq, hd, dim, inter, extra, out_f32, out);
    return cudaGetLastError();
}

/* Lifts a kernel's dynamic shared-memory limit and returns its occupancy at smem. */
template <typename K>
static int prep_kernel(K kern, int threads, size_t smem, int *occ, const char *name, sl_err *err)
{
    cudaError_t rc =
        cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
    if (rc == cudaSuccess)
        rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, kern, threads, smem);
    if (rc != cudaSuccess)
        return sl_err_set(err, SL_EIO, "prepare %s (smem %zu): %s", name, smem,
                          cudaGetErrorString(rc));
    return 0;
}

/* Sets the shared-memory limits of the kernels a context may launch and records the
 * occupancy (CTAs per SM) of the two quantized ones. */
static int prepare_kernels(sl_gpu_ctx *c, sl_err *err)
{
    const uint32_t dim = c->shape.dim;
    int occ = 0, rc;
    if (c->gu_maxv == 4)
        rc = prep_kernel(k_gateup_q2_k<GU_NW, 4, GU_PF, false, GU_MINB>, GU_NW * 32,
                         k_gateup_smem(dim, GU_NW, 4), &c->gu_occ, "k_gateup_q2_k", err);
    else
        rc = prep_kernel(k_gateup_q2_k<GU_NW, 8, GU_PF, false, GU_MINB>, GU_NW * 32,
                         k_gateup_smem(dim, GU_NW, 8), &c->gu_occ, "k_gateup_q2_k", err);
    if (rc) return rc;
    if (c->dn_maxv == 8)
        rc = prep_kernel(k_down2_q3_k<8, DN_T>, SL_GPU_MAX_USED * 32,
                         k_down2_smem(SL_GPU_MAX_USED, 8), &occ, "k_down2_q3_k", err);
    else
        rc = prep_kernel(k_down2_q3_k<16, DN_T>, SL_GPU_MAX_USED * 32,
                         k_down2_smem(SL_GPU_MAX_USED, 16), &occ, "k_down2_q3_k", err);
    if (rc) return rc;
    rc = prep_kernel(k_gateup_bf16<BF_NW>, BF_NW * 32, sizeof(float) * dim, &occ, "k_gateup_bf16",
                     err);
    if (rc) return rc;
    rc = prep_kernel(k_router<BF_NW>, BF_NW * 32, sizeof(float) * dim, &occ, "k_router", err);
    if (rc) return rc;
    if (c->gu_occ < 1 || occ < 1)
        return sl_err_set(err, SL_EUNSUPPORTED, "sl_gpu_open: kernels do not fit (occupancy %d/%d)",
                          c->gu_occ, occ);
    return 0;
}

static int alloc_scratch(sl_kscratch *s, uint32_t n, uint32_t inter, sl_err *err)
{
    CK(cudaMalloc((void **)&s->h, sizeof(float) * n * inter), "cudaMalloc(h)");
    CK(cudaMalloc((void **)&s->hq, (size_t)n * inter), "cudaMalloc(hq)");
    CK(cudaMalloc((void **)&s->hd, sizeof(float) * n * (inter / 32)), "cudaMalloc(hd)");
    CK(cudaMalloc((void **)&s->cnt, sizeof(unsigned) * n * (inter / 32)), "cudaMalloc(cnt)");
    CK(cudaMemset(s->cnt, 0, sizeof(unsigned) * n * (inter / 32)), "cudaMemset(cnt)");
    return 0;
}

static void free_scratch(sl_kscratch *s)
{
    cudaFree(s->h);
    cudaFree(s->hq);
    cudaFree(s->hd);
    cudaFree(s->cnt);
    memset(s, 0, sizeof *s);
}

static int open_inner(sl_gpu_ctx *c, sl_err *err)
{
    const sl_moe_shape *s = &c->shape;
    CK(cudaSetDevice(c->dev), "cudaSetDevice");
    CK(cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, c->dev),
       "cudaDeviceGetAttribute(SM count)");
    CK(cudaStreamCreateWithFlags(&c->main, cudaStreamNonBlocking), "cudaStreamCreate(main)");
    CK(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking), "cudaStreamCreate(side)");
    CK(cudaEventCreateWithFlags(&c->ev_in, cudaEventDisableTiming), "cudaEventCreate(in)");
    CK(cudaEventCreateWithFlags(&c->ev_sh, cudaEventDisableTiming), "cudaEventCreate(shared)");
    if (alloc_scratch(&c->rs, SL_GPU_MAX_USED, s->inter, err)) return err ? err->code : SL_EIO;
    if (alloc_scratch(&c->ss, 1, s->inter, err)) return err ? err->code : SL_EIO;
    CK(cudaMalloc((void **)&c->y_sh, sizeof(float) * s->dim), "cudaMalloc(y_sh)");
    CK(cudaMalloc((void **)&c->logits_dev, sizeof(float) * s->n_expert), "cudaMalloc(logits)");
    CK(cudaMallocHost((void **)&c->logits_host, sizeof(float) * s->n_expert),
       "cudaMallocHost(logits)");
    return prepare_kernels(c, err);
}

extern "C" int sl_gpu_open(sl_gpu_ctx **out, int dev, const sl_moe_shape *s, sl_err *err)
{
    if (!out || !s) return sl_err_set(err, SL_EINVAL, "sl_gpu_open: NULL argument");
    *out = NULL;
    if (s->dim == 0 || s->dim % 256 || s->dim > 12288 || s->inter == 0 || s->inter % 256 ||
        s->inter > 4608 || s->n_used == 0 || s->n_used > SL_GPU_MAX_USED || s->n_expert == 0)
        return sl_err_set(err, SL_EINVAL,
                          "sl_gpu_open: shape dim %u inter %u n_used %u n_expert %u not supported",
                          s->dim, s->inter, s->n_used, s->n_expert);
    if (s->gate_type != SL_QTYPE_Q2_K || s->up_type != SL_QTYPE_Q2_K ||
        s->down_type != SL_QTYPE_Q3_K)
        return sl_err_set(err, SL_EUNSUPPORTED,
                          "sl_gpu_open: routed types %u/%u/%u (want Q2_K/Q2_K/Q3_K)", s->gate_type,
                          s->up_type, s->down_type);
    const int sh_q = s->sh_gate_type == SL_QTYPE_Q2_K && s->sh_up_type == SL_QTYPE_Q2_K &&
                     s->sh_down_type == SL_QTYPE_Q3_K;
    const int sh_bf = s->sh_gate_type == SL_QTYPE_BF16 && s->sh_up_type == SL_QTYPE_BF16 &&
                      s->sh_down_type == SL_QTYPE_BF16;
    if (!sh_q && !sh_bf)
        return sl_err_set(err, SL_EUNSUPPORTED, "sl_gpu_open: shared types %u/%u/%u",
                          s->sh_gate_type, s->sh_up_type, s->sh_down_type);
    sl_gpu_ctx *c = (sl_gpu_ctx *)calloc(1, sizeof *c);
    if (!c) return sl_err_set(err, SL_ENOMEM, "sl_gpu_open: calloc(%zu)", sizeof *c);
    c->dev = dev;
    c->shape = *s;
    c->sh_bf16 = sh_bf;
    const uint32_t gu_chunks = (s->dim / 256 * 84 + 30) / 16,
                   dn_chunks = (4 * (s->inter / 256 * 110) + 30) / 16;
    c->gu_maxv = gu_chunks <= 128 ? 4 : 8;
    c->dn_maxv = dn_chunks <= 256 ? 8 : 16;
    const int rc = open_inner(c, err);
    if (rc) {
        sl_gpu_close(&c);
        return rc;
    }
    *out = c;
    return 0;
}

extern "C" void sl_gpu_close(sl_gpu_ctx **pc)
{
    if (!pc || !*pc) return;
    sl_gpu_ctx *c = *pc;
    if (c->main) cudaStreamSynchronize(c->main);
    if (c->side) cudaStreamSynchronize(c->side);
    free_scratch(&c->rs);
    free_scratch(&c->ss);
    cudaFree(c->y_sh);
    cudaFree(c->logits_dev);
    cudaFreeHost(c->logits_host);
    if (c->ev_in) cudaEventDestroy(c->ev_in);
    if (c->ev_sh) cudaEventDestroy(c->ev_sh);
    if (c->main) cudaStreamDestroy(c->main);
    if (c->side) cudaStreamDestroy(c->side);
    free(c);
    *pc = NULL;
}

extern "C" int sl_gpu_malloc(sl_gpu_ctx *c, void **dev, size_t bytes, sl_err *err)
{
    if (!c || !dev) return sl_err_set(err, SL_EINVAL, "sl_gpu_malloc: NULL argument");
    cudaError_t rc = cudaMalloc(dev, bytes);
    if (rc != cudaSuccess)
        return sl_err_set(err, SL_ENOMEM, "cudaMalloc(%zu): %s", bytes, cudaGetErrorString(rc));
    return 0;
}

extern "C" void sl_gpu_free(sl_gpu_ctx *c, void *dev)
{
    (void)c;
    if (dev) cudaFree(dev);
}

extern "C" int sl_gpu_upload(sl_gpu_ctx *c, void *dev, const void *host, size_t bytes, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_upload: NULL context");
    CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, c->main),
       "cudaMemcpyAsync(upload)");
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(upload)");
    return 0;
}

extern "C" int sl_gpu_download(sl_gpu_ctx *c, void *host, const void *dev, size_t bytes,
                               sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_download: NULL context");
    CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, c->main),
       "cudaMemcpyAsync(download)");
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(download)");
    return 0;
}

extern "C" int sl_gpu_host_register(void *host, size_t bytes, void **dev, sl_err *err)
{
    if (!host || !dev) return sl_err_set(err, SL_EINVAL, "sl_gpu_host_register: NULL argument");
    cudaError_t rc =
        cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (rc != cudaSuccess)
        return sl_err_set(err, SL_EIO, "cudaHostRegister(%p, %zu): %s", host, bytes,
                          cudaGetErrorString(rc));
    CK(cudaHostGetDevicePointer(dev, host, 0), "cudaHostGetDevicePointer");
    return 0;
}

extern "C" int sl_gpu_host_unregister(void *host, sl_err *err)
{
    CK(cudaHostUnregister(host), "cudaHostUnregister");
    return 0;
}

extern "C" int sl_gpu_sync(sl_gpu_ctx *c, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_sync: NULL context");
    CK(cudaStreamSynchronize(c->side), "cudaStreamSynchronize(side)");
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(main)");
    return 0;
}

extern "C" int sl_gpu_quant_q8_1(sl_gpu_ctx *c, const uint16_t *x, uint32_t n, sl_block_q8_1 *dst,
                                 sl_err *err)
{
    if (!c || !x || !dst || n % 32)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_quant_q8_1: bad arguments (n %u)", n);
    if (n == 0) return 0;
    const uint32_t blocks = n / 32, per = 8;
    k_quant_q8_1<<<(blocks + per - 1) / per, per * 32, 0, c->main>>>(x, n, dst);
    CK_LAUNCH("k_quant_q8_1");
    return 0;
}

extern "C" int sl_gpu_router_logits(sl_gpu_ctx *c, const uint16_t *x, const uint16_t *w,
                                    float *logits, sl_err *err)
{
    if (!c || !logits) return sl_err_set(err, SL_EINVAL, "sl_gpu_router_logits: NULL argument");
    if (check_ptr(x, "sl_gpu_router_logits: x", err) ||
        check_ptr(w, "sl_gpu_router_logits: w", err))
        return SL_EINVAL;
    const sl_moe_shape *s = &c->shape;
    const uint32_t grid = (s->n_expert + BF_NW - 1) / BF_NW;
    k_router<BF_NW><<<grid, BF_NW * 32, sizeof(float) * s->dim, c->main>>>(
        w, x, s->n_expert, s->dim, s->gate_temp, c->logits_dev);
    CK_LAUNCH("k_router");
    CK(cudaMemcpyAsync(c->logits_host, c->logits_dev, sizeof(float) * s->n_expert,
                       cudaMemcpyDeviceToHost, c->main),
       "cudaMemcpyAsync(logits)");
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(router)");
    memcpy(logits, c->logits_host, sizeof(float) * s->n_expert);
    return 0;
}

extern "C" int sl_gpu_moe_shared(sl_gpu_ctx *c, const uint16_t *x, const sl_moe_expert_w *sh,
                                 sl_err *err)
{
    if (!c || !sh) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_shared: NULL argument");
    if (check_ptr(x, "sl_gpu_moe_shared: x", err) ||
        check_ptr(sh->gate, "sl_gpu_moe_shared: gate", err) ||
        check_ptr(sh->up, "sl_gpu_moe_shared: up", err) ||
        check_ptr(sh->down, "sl_gpu_moe_shared: down", err))
        return SL_EINVAL;
    const sl_moe_shape *s = &c->shape;
    sl_ktab tab;
    memset(&tab, 0, sizeof tab);
    tab.n = 1;
    tab.e[0].gate = (const uint8_t *)sh->gate;
    tab.e[0].up = (const uint8_t *)sh->up;
    tab.e[0].down = (const uint8_t *)sh->down;
    tab.e[0].w = 1.0f;
    CK(cudaEventRecord(c->ev_in, c->main), "cudaEventRecord(in)");
    CK(cudaStreamWaitEvent(c->side, c->ev_in, 0), "cudaStreamWaitEvent(side, in)");
    if (c->sh_bf16) {
        const uint32_t gg = (s->inter + BF_NW - 1) / BF_NW, gd = (s->dim + BF_NW - 1) / BF_NW;
        k_gateup_bf16<BF_NW><<<gg, BF_NW * 32, sizeof(float) * s->dim, c->side>>>(
            tab, x, s->dim, s->inter, s->swiglu_limit, c->ss);
        CK_LAUNCH("k_gateup_bf16");
        k_down_bf16<BF_NW><<<gd, BF_NW * 32, sizeof(float) * s->inter, c->side>>>(
            (const uint16_t *)sh->down, c->ss.h, s->dim, s->inter, c->y_sh);
        CK_LAUNCH("k_down_bf16");
    } else {
        CK((launch_gateup(c->gu_maxv, c->gu_occ, c->n_sm, tab, x, s->dim, s->inter, s->swiglu_limit,
                          c->ss, c->side)),
           "k_gateup_q2_k(shared)");
        CK((launch_down(c->dn_maxv, tab, c->ss.hq, c->ss.hd, s->dim, s->inter, NULL, c->y_sh, NULL,
                        c->side)),
           "k_down_q3_k(shared)");
    }
    CK(cudaEventRecord(c->ev_sh, c->side), "cudaEventRecord(shared)");
    c->shared_pending = 1;
    return 0;
}

extern "C" int sl_gpu_moe_routed(sl_gpu_ctx *c, const uint16_t *x, const sl_moe_route *route,
                                 const sl_moe_expert_w *w, uint16_t *out, float *out_f32,
                                 sl_err *err)
{
    if (!c || !route || !w) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_routed: NULL argument");
    if (check_ptr(x, "sl_gpu_moe_routed: x", err) || check_ptr(out, "sl_gpu_moe_routed: out", err))
        return SL_EINVAL;
    const sl_moe_shape *s = &c->shape;
    const uint32_t n = s->n_used;
    uint32_t order[64];
    sl_emu_moe_order(route, n, order);
    sl_ktab tab;
    memset(&tab, 0, sizeof tab);
    tab.n = (int)n;
    for (uint32_t k = 0; k < n; k++) {
        const sl_moe_expert_w *e = &w[order[k]];
        char what[64];
        snprintf(what, sizeof what, "sl_gpu_moe_routed: expert %u", route->expert[order[k]]);
        if (check_ptr(e->gate, what, err) || check_ptr(e->up, what, err) ||
            check_ptr(e->down, what, err))
            return SL_EINVAL;
        tab.e[k].gate = (const uint8_t *)e->gate;
        tab.e[k].up = (const uint8_t *)e->up;
        tab.e[k].down = (const uint8_t *)e->down;
        tab.e[k].w = route->weight[order[k]];
    }
    CK((launch_gateup(c->gu_maxv, c->gu_occ, c->n_sm, tab, x, s->dim, s->inter, s->swiglu_limit,
                      c->rs, c->main)),
       "k_gateup_q2_k");
    const float *extra = NULL;
    if (c->shared_pending) {
        CK(cudaStreamWaitEvent(c->main, c->ev_sh, 0), "cudaStreamWaitEvent(main, shared)");
        extra = c->y_sh;
        c->shared_pending = 0;
    }
    CK((launch_down(c->dn_maxv, tab, c->rs.hq, c->rs.hd, s->dim, s->inter, extra, out_f32, out,
                    c->main)),
       "k_down_q3_k");
    c->n_last = n;
    return 0;
}

extern "C" int sl_gpu_moe_peek(sl_gpu_ctx *c, float *h, int8_t *hq, float *hd, float *h_sh,
                               float *y_sh, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_peek: NULL context");
    if (sl_gpu_sync(c, err)) return err ? err->code : SL_EIO;
    const size_t n = c->n_last, inter = c->shape.inter;
    if (h) CK(cudaMemcpy(h, c->rs.h, sizeof(float) * n * inter, cudaMemcpyDeviceToHost), "peek(h)");
    if (hq) CK(cudaMemcpy(hq, c->rs.hq, n * inter, cudaMemcpyDeviceToHost), "peek(hq)");
    if (hd)
        CK(cudaMemcpy(hd, c->rs.hd, sizeof(float) * n * (inter / 32), cudaMemcpyDeviceToHost),
           "peek(hd)");
    if (h_sh)
        CK(cudaMemcpy(h_sh, c->ss.h, sizeof(float) * inter, cudaMemcpyDeviceToHost), "peek(h_sh)");
    if (y_sh)
        CK(cudaMemcpy(y_sh, c->y_sh, sizeof(float) * c->shape.dim, cudaMemcpyDeviceToHost),
           "peek(y_sh)");
    return 0;
}
