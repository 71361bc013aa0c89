/* moe.cu - the C entries of the MoE kernels: context, memory helpers, router, shared
 * expert and routed experts of one token (DESIGN.md "One decode step"), whole or split
 * hits first (begin / part / finish).
 *
 * The context owns three streams (main; side, for a shared expert that does not run
 * with the routed ones; copy, for sl_gpu_upload_async), the events that join them, all scratch
 * (sized at open: a layer allocates nothing) and the state of the token between sl_gpu_moe_begin
 * and sl_gpu_moe_finish. Kernels come from moe_kern.cuh; the configuration below is the one that
 * won in bench/gpu/moe (bench/results/2026-11-30-moe.md). Every CUDA call and every launch is
 * checked with a label.
 */
#include <cuda_runtime.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu.h"
#include "moe_kern.cuh"

/* The bench's winners. Weights in device memory: bulk-copy (TMA) gate/up and down
 * (bench/results/2026-11-30-moe.md). Weights in mapped host memory (the zero-copy
 * path): run 4's register-staged kernels, which keep >= 0.9 of the PCIe ceiling
 * (bench/results/2026-11-29-moe.md). */
#define GU_NW   8    /* warps per CTA, register-staged gate/up */
#define GU_PF   true /* prefetch the next row pair */
#define GU_MINB 1    /* __launch_bounds__ min CTAs per SM, gate/up */
#define BF_NW   8    /* BF16 shared expert and the plain router */
#define RT_NW   4    /* warps (experts) per CTA, prefetching router */
#define DN_T    1    /* 4-row tiles per CTA, register-staged down */
#define GT_NG   2    /* warp groups per CTA, bulk-copy gate/up (2 CTAs an SM) */
#define GT_NW   4    /* warps per group, bulk-copy gate/up */
#define GT_TR   8    /* rows of gate (and of up) per stage */
#define GT_ST   4    /* stages in flight per CTA (2 per group) */
#define GT_STG  1    /* host-table gate/up: one stage a group first, the rest once it landed */
#define GT_QH   3    /* host-table gate/ups write h's q8_1 (3: a group's 32 rows; 0: not) */
#define GTD_QH  4    /* the device-table gate/up's (4: a CTA's 32 rows, its two groups) */
#define DP_LPR  4    /* lanes per row (raw blocks: k_dot2_q3_k), bulk-copy down */
#define DP_TD   8    /* output rows per tile (stage), bulk-copy down */
#define DP_ST   2    /* stages per CTA, bulk-copy down (1: one tile a CTA, grid = tiles) */
#define DP_NG   2    /* warp groups per CTA, persistent bulk-copy down */
#define DP_UNR  1    /* tiled down: a block at a time (bench: 2 and 3 interleaved lost) */
#define PK_RING 4    /* stages of Q3_K downs between the copy and their tiling */
#define RT_C    24   /* 16-byte chunks per lane of the prefetching router (dim <= 6144) */
#define RT_CX   20   /* the same for dim 5120 exactly (the model's): constant bounds */
#ifndef GT_NBX
#define GT_NBX 20 /* the bulk-copy gate/ups' blocks a row at dim 5120 (a constant; 0: none) */
#endif
#ifndef GT_SPL
#define GT_SPL 1 /* their stages split (SL_GU_SPLIT_GAP; 0: a stage's rows together) */
#endif
#ifdef SL_GT_ST /* an experiment's arm: the bulk-copy gate/ups' stages a CTA */
#undef GT_ST
#define GT_ST SL_GT_ST
#endif
#ifdef SL_GTD_QH /* an experiment's arm: the device-table gate/up's form of h's q8_1 */
#undef GTD_QH
#define GTD_QH SL_GTD_QH
#endif
#ifndef SL_GU_PW /* an experiment's arm: the bulk-copy gate/ups' producer warp */
#define SL_GU_PW 0
#endif
#define GT_PW      (SL_GU_PW != 0)
#define GT_THREADS (GT_NG * GT_NW * 32 + (GT_PW ? 32 : 0)) /* a bulk-copy gate/up CTA's */
#ifndef USE_PDL
#define USE_PDL true /* programmatic dependent launch between the bulk-copy kernels */
#endif

/* Where the shared expert of the next token is. A K-quant shared expert in device
 * memory runs with the routed experts (one more entry, slot n_used, weight 1, in the
 * same gate/up and down launches; its down output is the last term of the fixed-order
 * sum, which is where the side-stream path adds it, so the bits are the same); a BF16
 * one, or one in host memory, runs on the side stream. */
enum { SH_NONE, SH_SIDE, SH_MERGE, SH_MERGED };

struct sl_gpu_ctx {
    int dev, n_sm;
    sl_moe_shape shape;
    int sh_bf16;          /* 1: the shared expert is BF16 */
    int gu_maxv, dn_maxv; /* register chunks per lane of one step (4|8, 8|16) */
    int gu_occ;           /* CTAs per SM of the register-staged gate/up */
    int gt_ok, gt_occ;    /* the bulk-copy gate/up fits this shape; its CTAs per SM */
    int gt_stg;           /* its staggered start (GT_STG; sl_gpu_set_probe) */
    int gtd_flag;         /* the device-table gate/up starts on the selection's flag */
    int gt_qh;            /* the bulk-copy gate/ups' q8_1 of h: 0, 3, 4 (GT_QH; sl_gpu_set_probe) */
    int gtd_qh;           /* the device-table gate/up's (GTD_QH; sl_gpu_set_probe) */
    unsigned long long *dn_stamps;   /* the down's milestones (bench; rs.stamps the gate/up's) */
    unsigned long long *rt_stamps;   /* the router's and the selection's (bench) */
    int gtd_ok, gtd_occ;             /* its device-table form fits too (routing on the device) */
    int dt_ok;                       /* the bulk-copy down fits this shape */
    int dt_occ[SL_GPU_MAX_USED + 1]; /* its CTAs per SM for n experts (persistent grid) */
    cudaStream_t main, side;
    cudaStream_t copy;    /* sl_gpu_upload_async: host -> device beside the kernels */
    cudaEvent_t ev_copy;  /* the copies queued so far (main waits before reading them) */
    cudaEvent_t ev_fence; /* the end of the last token's work (copies wait for it) */
    int copies_pending;   /* copies queued since the main stream last waited for them */
    /* Q3_K downs on their way into device memory (sl_gpu_upload_down_async): the copy
     * stream brings the raw blocks into a stage of the ring, the main stream tiles them
     * (at its next join_copies, so that the tiling never waits on the copy stream for
     * SMs that the kernels hold), and the stage is reused once its tiling is done. */
    struct {
        uint8_t *buf;     /* pk_cap bytes */
        cudaEvent_t done; /* the tiling that read it (main stream) */
        int recorded;     /* done has been recorded */
    } pk[PK_RING];
    uint64_t pk_cap; /* bytes of a stage: one raw down of the shape */
    struct {
        uint32_t ring;
        uint8_t *dst;
        uint64_t n;     /* 8-row tiles */
    } pk_wait[PK_RING]; /* copied, not tiled yet: the last n_pk_wait stages taken */
    uint32_t n_pk_wait;
    uint32_t pk_next; /* the stage the next upload takes, mod PK_RING */
    int fence_new;    /* ev_fence recorded since the copy stream last waited */
    cudaEvent_t ev_in, ev_sh;
    cudaEvent_t ev_logits;  /* the router's logits are in logits_host */
    int router_pending;     /* sl_gpu_router_start without its wait yet */
    int sh_state;           /* the shared expert of the next routed call: SH_* */
    sl_kexp sh;             /* its entry when it runs with the routed experts */
    const uint16_t *sh_x;   /* its x then */
    uint32_t n_last;        /* experts of the last routed call (for peek) */
    int last_merged;        /* the last call ran the shared expert with the routed ones */
    sl_kscratch rs, ss;     /* routed [SL_GPU_MAX_USED] and shared [1] scratch */
    float *y_sh;            /* [dim] the shared expert's output */
    float *logits_host;     /* [n_expert] pinned, mapped */
    float *logits_host_dev; /* its device address */
    /* routing on the device (sl_gpu_route_start / wait) */
    float *logits_dev;                 /* [n_expert] */
    sl_kroute *kroute, *kroute_dev;    /* the picks for the host: pinned, mapped */
    sl_moe_route *forced, *forced_dev; /* a synthetic routing: pinned, mapped */
    sl_ktab *tab_dev;                  /* the device tier's picks, for gate/up */
    sl_kttab *ttab_dev;                /* the same, tagged with its routing (k_route_select) */
    cudaEvent_t ev_picks;              /* route_start's work is done (the spin's watchdog) */
    int route_pending;                 /* sl_gpu_route_start without its wait yet */
    uint32_t route_seq;                /* the number of the last routing queued */
    unsigned ttab_tag;                 /* the last selection's tag of ttab_dev: 1..15 in turn */
    const uint16_t *route_x;           /* x of the pending routing */
    uint8_t *ximg[2]; /* x quantized for the bulk-copy gate/up (k_quant_x_img): main, side */
    /* the token between sl_gpu_moe_begin and sl_gpu_moe_finish */
    int in_token;
    const uint16_t *x;                 /* [dim] bf16, device */
    sl_moe_route route;                /* by rank */
    uint32_t slot_of[SL_GPU_MAX_USED]; /* rank -> position in increasing expert id */
    uint32_t queued;                   /* bit r: rank r's gate/up is queued */
    sl_ktab all;                       /* by slot: the down pointers for finish */
    uint32_t early;                    /* slots whose down ran early (sl_gpu_moe_down_early) */
    uint32_t qh_done;                  /* slots whose q8_1 of h their gate/up wrote */
    float *ys;                         /* [SL_GPU_MAX_USED][dim] their rows, apart */
    int down_host;                     /* some queued expert's down is in host memory */
    /* timeline marks (sl_gpu_mark): created on first use */
    cudaEvent_t *marks; /* [SL_GPU_MARKS] */
    uint32_t n_marks;   /* recorded since the anchor; 0 = no anchor yet */
    uint64_t anchor_ns; /* CLOCK_MONOTONIC when mark 0 had completed */
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

/* 1 when p is not device memory (registered host memory, read over PCIe): the bulk
 * copies are for device memory, the register-staged kernels for mapped host memory.
 * A pointer lookup in the driver, well under a microsecond. */
static int in_host(const void *p)
{
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError(); /* clear it: an unknown pointer is not a launch error */
        return 1;
    }
    return a.type != cudaMemoryTypeDevice;
}

/* The main stream waits for the copies queued so far (before work that reads them),
 * then tiles the Q3_K downs among them. */
static cudaError_t join_copies(sl_gpu_ctx *c)
{
    if (!c->copies_pending) return cudaSuccess;
    c->copies_pending = 0;
    cudaError_t rc = cudaEventRecord(c->ev_copy, c->copy);
    if (rc == cudaSuccess) rc = cudaStreamWaitEvent(c->main, c->ev_copy, 0);
    uint32_t i = 0;
    for (; i < c->n_pk_wait && rc == cudaSuccess; i++) {
        const uint32_t r = c->pk_wait[i].ring;
        const uint32_t nb = c->shape.inter / 256;
        const uint64_t words = c->pk_wait[i].n * nb * (SL_Q3K_TB / 4);
        rc = k_launch(k_pack_q3_k_tb, (uint32_t)((words + 255) / 256), 256, 0, c->main, false,
                      (const uint8_t *)c->pk[r].buf, (uint32_t)c->pk_wait[i].n, nb,
                      c->pk_wait[i].dst);
        if (rc == cudaSuccess) rc = cudaEventRecord(c->pk[r].done, c->main);
        if (rc != cudaSuccess) break;
        c->pk[r].recorded = 1;
    }
    /* on a failure the tilings not queued stay for the next join (queueing one twice
     * writes the same bytes) */
    memmove(c->pk_wait, c->pk_wait + i, sizeof *c->pk_wait * (c->n_pk_wait - i));
    c->n_pk_wait -= i;
    if (rc != cudaSuccess) c->copies_pending = 1;
    return rc;
}

/* Shared memory of the bulk-copy gate/up. */
static size_t gt_smem(uint32_t dim)
{
    return k_gateup_tma_smem(dim, GT_TR, GT_ST, 0, 0, GT_SPL, GT_PW);
}

/* ---- launchers, one per kernel family ---- */

/* x quantized into img for the bulk-copy gate/up that follows on st. */
static cudaError_t launch_quant_img(const sl_gpu_ctx *c, const uint16_t *x, uint8_t *img,
                                    cudaStream_t st, bool pdl)
{
    const uint32_t blocks = c->shape.dim / 32;
    return k_launch(k_quant_x_img, (blocks + 7) / 8, 256, 0, st, pdl, x, c->shape.dim, img);
}

/* The bulk-copy gate/ups' pointer types (every form of a family has the same), named
 * after a form that is built */
using gt_fn = decltype(&k_gateup_tma_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, false, false, 0,
                                          0, GT_SPL, GT_PW>);
using gtd_fn = decltype(&k_gateup_tma_dev_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, false,
                                               false, 0, 0, GT_SPL, GT_PW>);

/* The host-table bulk-copy gate/up: staggered or not, recording milestones or not,
 * writing h's q8_1 in form qh (3, 4: compute/moe_kern.cuh) or leaving it to k_quant_h;
 * NB: the form for dim 256 NB exactly (0: any dim). */
template <bool STG, bool STAMP, int NB> static gt_fn gt_kernel_qh(int qh)
{
    if (qh == 3)
        return k_gateup_tma_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, STG, STAMP, 3, NB,
                                 GT_SPL, GT_PW>;
    if (qh == 4)
        return k_gateup_tma_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, STG, STAMP, 4, NB,
                                 GT_SPL, GT_PW>;
    return k_gateup_tma_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, STG, STAMP, 0, NB, GT_SPL,
                             GT_PW>;
}

/* Whether the gate/ups take their form for the model's width (GT_NBX blocks a row). */
static bool gt_exact(uint32_t dim)
{
    return GT_NBX && dim == 256u * GT_NBX;
}

template <int NB> static gt_fn gt_kernel_nb(bool stg, bool stamp, int qh)
{
    if (stamp) return stg ? gt_kernel_qh<true, true, NB>(qh) : gt_kernel_qh<false, true, NB>(qh);
    return stg ? gt_kernel_qh<true, false, NB>(qh) : gt_kernel_qh<false, false, NB>(qh);
}

static gt_fn gt_kernel(bool stg, bool stamp, int qh, uint32_t dim)
{
    return gt_exact(dim) ? gt_kernel_nb<GT_NBX>(stg, stamp, qh) : gt_kernel_nb<0>(stg, stamp, qh);
}

/* The device-table gate/up, recording milestones or not, h's q8_1 and NB as gt_kernel's. */
template <bool STAMP, int NB> static gtd_fn gtd_kernel_qh(int qh)
{
    if (qh == 3)
        return k_gateup_tma_dev_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, false, STAMP, 3, NB,
                                     GT_SPL, GT_PW>;
    if (qh == 4)
        return k_gateup_tma_dev_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, false, STAMP, 4, NB,
                                     GT_SPL, GT_PW>;
    return k_gateup_tma_dev_q2_k<GT_NW, GT_TR, GT_ST, GT_NG, false, false, false, STAMP, 0, NB,
                                 GT_SPL, GT_PW>;
}

static gtd_fn gtd_kernel(bool stamp, int qh, uint32_t dim)
{
    if (gt_exact(dim))
        return stamp ? gtd_kernel_qh<true, GT_NBX>(qh) : gtd_kernel_qh<false, GT_NBX>(qh);
    return stamp ? gtd_kernel_qh<true, 0>(qh) : gtd_kernel_qh<false, 0>(qh);
}

/* The CTAs of a bulk-copy gate/up of `units` units, at most occ an SM: with h's q8_1
 * (qh), no more than the chunks (32 / GT_TR units each). */
static uint32_t gt_grid(const sl_gpu_ctx *c, uint32_t units, int occ, int qh)
{
    uint32_t grid = (uint32_t)(occ * c->n_sm);
    const uint32_t need = qh ? units / (32 / GT_TR) : units;
    return grid > need ? need : grid;
}

/* The form of h's q8_1 for a host-table bulk-copy gate/up of n experts: in the gate/up
 * (c->gt_qh) when its chunks keep at least half of the warp groups busy; else 0, and
 * k_quant_h after it (a launch of few experts would give each group whole chunks, 4
 * units in turn, where the round-robin order spreads them over every group). */
static int gt_qh_for(const sl_gpu_ctx *c, int n)
{
    const uint32_t chunks = (uint32_t)n * (c->shape.inter / 32);
    return 2 * chunks >= (uint32_t)(c->gt_occ * c->n_sm * GT_NG) ? c->gt_qh : 0;
}

/* The bulk-copy down on tiled downs (device memory), recording milestones or not; raw:
 * on raw GGUF blocks (a down in host memory after sl_gpu_moe_down_early), no milestones. */
static decltype(&k_down_pt_q3_k<DP_LPR, DP_TD, DP_ST, DP_NG, true, false, SL_Q3K_PACKED, DP_UNR,
                                false, true>)
dp_kernel(bool stamp, bool raw = false)
{
    static_assert(DP_TD * DP_LPR == 32, "a warp an expert's tile (early refill; tiled layout)");
    if (raw) return k_down_pt_q3_k<DP_LPR, DP_TD, DP_ST, DP_NG, true, false, 110>;
    return stamp ? k_down_pt_q3_k<DP_LPR, DP_TD, DP_ST, DP_NG, true, true, SL_Q3K_PACKED, DP_UNR,
                                  false, true>
                 : k_down_pt_q3_k<DP_LPR, DP_TD, DP_ST, DP_NG, true, false, SL_Q3K_PACKED, DP_UNR,
                                  false, true>;
}

/* The bulk-copy down's grid for n experts: persistent (ST > 1), as many CTAs as fit;
 * else one per tile. */
static uint32_t dp_grid(const sl_gpu_ctx *c, int n)
{
    const uint32_t tiles = c->shape.dim / DP_TD;
    const uint32_t fit = (uint32_t)(c->dt_occ[n] * c->n_sm);
    return DP_ST == 1 || fit > tiles ? tiles : fit;
}

/* Gate/up + SwiGLU of the table's experts into s.h (at each expert's slot); tma picks
 * the bulk-copy kernel (weights in device memory), after k_quant_x_img on st: pdl then
 * says whether that kernel may overlap the one before it, the gate/up always overlaps
 * k_quant_x_img's end. *wrote_qh (if given): whether the launch also wrote the experts'
 * q8_1 of h (gt_qh_for), so that no k_quant_h need follow for them. */
static cudaError_t launch_gateup(const sl_gpu_ctx *c, const sl_ktab &tab, const uint16_t *x,
                                 const sl_kscratch &s, cudaStream_t st, bool tma, bool pdl,
                                 bool *wrote_qh = NULL)
{
    if (wrote_qh) *wrote_qh = false;
    const uint32_t dim = c->shape.dim, inter = c->shape.inter;
    const float limit = c->shape.swiglu_limit;
    if (tma) {
        uint8_t *img = c->ximg[st == c->side];
        cudaError_t rc = launch_quant_img(c, x, img, st, pdl);
        if (rc != cudaSuccess) return rc;
        const int qh = gt_qh_for(c, tab.n);
        const uint32_t grid = gt_grid(c, (uint32_t)tab.n * (inter / GT_TR), c->gt_occ, qh);
        rc = k_launch(gt_kernel(c->gt_stg, s.stamps != NULL, qh, dim), grid, GT_THREADS,
                      gt_smem(dim), st, USE_PDL, tab, (const uint8_t *)img, dim, inter, limit, s);
        if (rc == cudaSuccess && wrote_qh) *wrote_qh = qh != 0;
        return rc;
    }
    const uint32_t units = (uint32_t)tab.n * inter;
    uint32_t grid = (units + GU_NW - 1) / GU_NW;
    if (grid > (uint32_t)(c->gu_occ * c->n_sm)) grid = (uint32_t)(c->gu_occ * c->n_sm);
    const size_t smem = k_gateup_smem(dim, GU_NW, c->gu_maxv);
    if (c->gu_maxv == 4)
        k_gateup_q2_k<GU_NW, 4, GU_PF, false, GU_MINB>
            <<<grid, GU_NW * 32, smem, st>>>(tab, x, dim, inter, limit, s);
    else
        k_gateup_q2_k<GU_NW, 8, GU_PF, false, GU_MINB>
            <<<grid, GU_NW * 32, smem, st>>>(tab, x, dim, inter, limit, s);
    return cudaGetLastError();
}

/* q8_1 of h of the experts whose slot bit is set in mask, of the first n slots (no
 * launch when none is). */
static cudaError_t launch_quant_h(const sl_gpu_ctx *c, const sl_kscratch &s, uint32_t n,
                                  uint32_t mask, cudaStream_t st, bool pdl)
{
    const uint32_t gpe = c->shape.inter / 32, groups = n * gpe;
    if (!(mask & ((1ull << n) - 1))) return cudaSuccess; /* every gate/up wrote its own */
    return k_launch(k_quant_h_pdl, (groups + 7) / 8, 256, 0, st, pdl, s, groups, gpe, mask);
}

/* Notes the layout of slot's down in c->all (tiled in device memory, raw in host
 * memory) and whether the token's downs need the register-staged kernel. */
static void note_down(sl_gpu_ctx *c, uint32_t slot)
{
    const int host = in_host(c->all.e[slot].down);
    if (host)
        c->all.pk &= ~(1u << slot);
    else
        c->all.pk |= 1u << slot;
    if (!c->dt_ok || host) c->down_host = 1;
}

/* The merged shared expert into c->all, at slot n_used (merged only from device memory:
 * its down is tiled). */
static void merge_shared(sl_gpu_ctx *c)
{
    const uint32_t n = c->shape.n_used;
    c->all.e[n] = c->sh;
    c->all.pk |= 1u << n;
}

/* The table of the slots in mask (from c->all). */
static sl_ktab slots_tab(const sl_gpu_ctx *c, uint32_t mask)
{
    sl_ktab t;
    memset(&t, 0, sizeof t);
    for (int i = 0; i < SL_GPU_MAX_USED; i++)
        if (mask >> i & 1) {
            t.pk |= (c->all.pk >> i & 1) << t.n;
            t.e[t.n++] = c->all.e[i];
        }
    return t;
}

/* Down of the table's experts and their fixed-order sum (+ extra); with part (tma
 * only), each expert's rows written apart there at its slot instead (k_combine sums).
 * The bulk-copy kernel takes a table of tiled downs only (device memory), or, with
 * part, of raw ones only (tab.pk says which). */
static cudaError_t launch_down(const sl_gpu_ctx *c, const sl_ktab &tab, const sl_kscratch &s,
                               const float *extra, float *out_f32, uint16_t *out, cudaStream_t st,
                               bool tma, bool pdl, float *part = NULL)
{
    const uint32_t dim = c->shape.dim, inter = c->shape.inter;
    if (tma) {
        const bool raw = tab.pk == 0;
        SL_ASSERT(tab.pk == (1u << tab.n) - 1 || (raw && part)); /* one layout a launch */
        /* milestones of the main stream's downs only (not the side stream's shared one) */
        unsigned long long *stamps = st == c->main && !raw ? c->dn_stamps : NULL;
        return k_launch(dp_kernel(stamps != NULL, raw), dp_grid(c, tab.n),
                        k_dpt_threads(tab.n, DP_LPR, DP_TD, DP_NG),
                        k_dpt_smem(tab.n, inter, DP_TD, DP_ST, raw ? 110 : SL_Q3K_PACKED), st, pdl,
                        tab, (const int8_t *)s.hq, (const float *)s.hd, dim, inter, extra, out_f32,
                        out, part, stamps);
    }
    const size_t smem = k_down2_smem(tab.n, c->dn_maxv);
    const uint32_t grid = (dim / 4 + DN_T - 1) / DN_T;
    if (c->dn_maxv == 8)
        k_down2_q3_k<8, DN_T>
            <<<grid, 32 * tab.n, smem, st>>>(tab, s.hq, s.hd, dim, inter, extra, out_f32, out);
    else
        k_down2_q3_k<16, DN_T>
            <<<grid, 32 * tab.n, smem, st>>>(tab, s.hq, s.hd, dim, inter, extra, out_f32, out);
    return cudaGetLastError();
}

/* The residual (h_out = bf16(h + y), h itself when h_out is NULL) and, unless w is
 * NULL, x = the norm of it (sl_emu_residual_norm), one CTA on the main stream. */
static cudaError_t launch_norm(const sl_gpu_ctx *c, const uint16_t *h, const uint16_t *y,
                               uint16_t *h_out, const float *w, float eps, uint16_t *x)
{
    const uint32_t dim = c->shape.dim;
    /* PDL: the CTA starts (and loads w) while the down before it drains */
    return k_launch(dim <= 24 * SL_EMU_NORM_LANES ? k_residual_norm<24> : k_residual_norm<0>, 1,
                    SL_EMU_NORM_LANES, 0, c->main, USE_PDL, h, y, w, eps, dim, x,
                    y && h_out ? h_out : (uint16_t *)h);
}

/* Whether k_router_pf computes the norm itself at this shape (else launch_norm runs
 * before it) and its shared memory then: x and the lanes' sums. */
static bool router_norms(const sl_moe_shape *s)
{
    return s->dim <= 256 * RT_C && s->dim % SL_EMU_NORM_LANES == 0;
}

static size_t router_norm_smem(const sl_moe_shape *s)
{
    return sizeof(float) * ((size_t)s->dim + SL_EMU_NORM_LANES);
}

/* The prefetching router for dim (<= 256 RT_C), with the norm inside it or not: at the
 * model's width (256 RT_CX) the form whose row bounds are constants; its name into
 * *name (for prep_kernel's errors) when name is not NULL. */
static decltype(&k_router_pf<RT_NW, RT_C>) router_pf(uint32_t dim, bool norm, const char **name)
{
    const bool exact = dim == 256 * RT_CX;
    if (name)
        *name = exact ? (norm ? "k_router_pf (norm, exact)" : "k_router_pf (exact)")
                      : (norm ? "k_router_pf (norm)" : "k_router_pf");
    if (exact)
        return norm ? k_router_pf<RT_NW, RT_CX, true, true>
                    : k_router_pf<RT_NW, RT_CX, false, true>;
    return norm ? k_router_pf<RT_NW, RT_C, true> : k_router_pf<RT_NW, RT_C>;
}

/* Router logits of x into logits (device-visible): the prefetching kernel, which
 * overlaps its weight loads with the kernel before it, where its registers hold a row
 * share. With ximg, x is also quantized there for the bulk-copy gate/up. Both forms
 * let the next kernel start only once the kernel before them has completed (the
 * selection relies on it: launch_select). With nm (nm->x is x), x is first computed
 * from the residual stream: in each of the router's CTAs where the shape allows
 * (router_norms), else by launch_norm before it. */
static cudaError_t launch_router(const sl_gpu_ctx *c, const uint16_t *x, const uint16_t *w,
                                 float *logits, uint8_t *ximg, const k_rnorm *nm = nullptr)
{
    const sl_moe_shape *s = &c->shape;
    const uint32_t grid = (s->n_expert + BF_NW - 1) / BF_NW;
    const size_t smem = sizeof(float) * s->dim;
    const bool in_router = nm && router_norms(s);
    if (nm && !in_router) {
        const cudaError_t rc = launch_norm(c, nm->h, nm->y, nm->h_out, nm->w, nm->eps, nm->x);
        if (rc != cudaSuccess) return rc;
    }
    if (s->dim <= 256 * RT_C) /* router_norms implies it */
        return k_launch(router_pf(s->dim, in_router, NULL), (s->n_expert + RT_NW - 1) / RT_NW,
                        RT_NW * 32, in_router ? router_norm_smem(s) : smem, c->main, USE_PDL, w, x,
                        s->n_expert, s->dim, s->gate_temp, logits, ximg, c->rt_stamps,
                        in_router ? *nm : k_rnorm{});
    if (ximg) {
        const cudaError_t rc = launch_quant_img(c, x, ximg, c->main, USE_PDL);
        if (rc != cudaSuccess) return rc;
    }
    k_router<BF_NW>
        <<<grid, BF_NW * 32, smem, c->main>>>(w, x, s->n_expert, s->dim, s->gate_temp, logits);
    return cudaGetLastError();
}

/* Lifts a kernel's dynamic shared-memory limit to smem and returns its occupancy. */
template <typename K>
static int prep_kernel(K kern, int threads, size_t smem, int *occ, const char *name, sl_err *err)
{
    cudaError_t rc = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)(smem > 48 * 1024 ? smem : 48 * 1024));
    if (rc == cudaSuccess)
        rc = cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, kern, threads, smem);
    if (rc != cudaSuccess)
        return sl_err_set(err, SL_EIO, "prepare %s (smem %zu): %s", name, smem,
                          cudaGetErrorString(rc));
    return 0;
}

/* Sets the shared-memory limits of the kernels a context may launch and records the
 * occupancy of the persistent gate/up kernels; the bulk-copy kernels are used where
 * their stages fit the device's shared memory. */
static int prepare_kernels(sl_gpu_ctx *c, sl_err *err)
{
    const uint32_t dim = c->shape.dim, inter = c->shape.inter;
    int occ = 0, rc, optin = 0;
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->dev),
       "cudaDeviceGetAttribute(shared memory)");
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
    const size_t gts = gt_smem(dim);
    if (gts <= (size_t)optin) {
        c->gt_occ = 1 << 30; /* the least of its twelve forms (the same shape) */
        for (int f = 0; f < 12; f++) {
            int o = 0;
            rc = prep_kernel(gt_kernel(f & 1, f >> 1 & 1, f >> 2 ? 2 + (f >> 2) : 0, dim),
                             GT_THREADS, gts, &o, "k_gateup_tma_q2_k", err);
            if (rc) return rc;
            if (o < c->gt_occ) c->gt_occ = o;
        }
        c->gt_stg = GT_STG; /* the device-table form starts with the shared expert */
        c->gtd_flag = 1;
        c->gt_qh = GT_QH;
        c->gtd_qh = GTD_QH;
        c->gt_ok = c->gt_occ >= 1;
    }
    /* tiled downs: a tile as long as in 112-byte packed blocks (moe_emu.h) */
    const size_t dt_smem = k_dpt_smem(SL_GPU_MAX_USED, inter, DP_TD, DP_ST, SL_Q3K_PACKED);
    if (dt_smem + 2048 <= (size_t)optin) {         /* + its static arrays */
        for (int n = 1; n <= SL_GPU_MAX_USED; n++) /* the last sets the largest limit */
            for (int stamp = 0; stamp < 2; stamp++) {
                int o = 0;
                rc = prep_kernel(dp_kernel(stamp), (int)k_dpt_threads(n, DP_LPR, DP_TD, DP_NG),
                                 k_dpt_smem(n, inter, DP_TD, DP_ST, SL_Q3K_PACKED), &o,
                                 "k_down_pt_q3_k", err);
                if (rc) return rc;
                if (!stamp || o < c->dt_occ[n]) c->dt_occ[n] = o;
            }
        int o = 0; /* the raw form (dp_grid's CTAs must fit it too) */
        rc = prep_kernel(
            dp_kernel(false, true), (int)k_dpt_threads(SL_GPU_MAX_USED, DP_LPR, DP_TD, DP_NG),
            k_dpt_smem(SL_GPU_MAX_USED, inter, DP_TD, DP_ST), &o, "k_down_pt_q3_k (raw)", err);
        if (rc) return rc;
        c->dt_ok = c->dt_occ[SL_GPU_MAX_USED] >= 1 && o >= c->dt_occ[SL_GPU_MAX_USED];
    }
    rc = prep_kernel(k_gateup_bf16<BF_NW>, BF_NW * 32, sizeof(float) * dim, &occ, "k_gateup_bf16",
                     err);
    if (rc) return rc;
    rc = prep_kernel(k_router<BF_NW>, BF_NW * 32, sizeof(float) * dim, &occ, "k_router", err);
    if (rc) return rc;
    const char *name;
    if (dim <= 256 * RT_C) {
        int o2 = 0;
        const auto k = router_pf(dim, false, &name);
        rc = prep_kernel(k, RT_NW * 32, sizeof(float) * dim, &o2, name, err);
        if (rc) return rc;
    }
    if (router_norms(&c->shape)) {
        int o3 = 0;
        const auto k = router_pf(dim, true, &name);
        rc = prep_kernel(k, RT_NW * 32, router_norm_smem(&c->shape), &o3, name, err);
        if (rc) return rc;
    }
    if (c->gt_ok) { /* its static table needs a little more shared memory: else unused */
        c->gtd_ok = 1;
        c->gtd_occ = 1 << 30; /* the least of its six forms */
        for (int f = 0; f < 6 && c->gtd_ok; f++) {
            int o = 0;
            c->gtd_ok = !prep_kernel(gtd_kernel(f & 1, f >> 1 ? 2 + (f >> 1) : 0, dim), GT_THREADS,
                                     gts, &o, "k_gateup_tma_dev_q2_k", NULL) &&
                        o >= 1;
            if (o < c->gtd_occ) c->gtd_occ = o;
        }
#ifdef SL_GTD_OCC /* an experiment's arm: at most this many CTAs an SM */
        if (c->gtd_occ > SL_GTD_OCC) c->gtd_occ = SL_GTD_OCC;
#endif
        (void)cudaGetLastError();
    }
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
    CK(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking), "cudaStreamCreate(copy)");
    CK(cudaEventCreateWithFlags(&c->ev_copy, cudaEventDisableTiming), "cudaEventCreate(copy)");
    CK(cudaEventCreateWithFlags(&c->ev_fence, cudaEventDisableTiming), "cudaEventCreate(fence)");
    c->pk_cap = (uint64_t)s->dim * (s->inter / 256) * 110;
    for (int i = 0; i < PK_RING; i++) {
        CK(cudaEventCreateWithFlags(&c->pk[i].done, cudaEventDisableTiming),
           "cudaEventCreate(tile)");
        CK(cudaMalloc((void **)&c->pk[i].buf, c->pk_cap), "cudaMalloc(tiling stage)");
    }
    CK(cudaEventCreateWithFlags(&c->ev_in, cudaEventDisableTiming), "cudaEventCreate(in)");
    CK(cudaEventCreateWithFlags(&c->ev_sh, cudaEventDisableTiming), "cudaEventCreate(shared)");
    CK(cudaEventCreateWithFlags(&c->ev_logits, cudaEventDisableTiming), "cudaEventCreate(logits)");
    if (alloc_scratch(&c->rs, SL_GPU_MAX_USED, s->inter, err)) return err ? err->code : SL_EIO;
    if (alloc_scratch(&c->ss, 1, s->inter, err)) return err ? err->code : SL_EIO;
    CK(cudaMalloc((void **)&c->y_sh, sizeof(float) * s->dim), "cudaMalloc(y_sh)");
    CK(cudaMalloc((void **)&c->ys, sizeof(float) * SL_GPU_MAX_USED * s->dim), "cudaMalloc(ys)");
    CK(cudaHostAlloc((void **)&c->logits_host, sizeof(float) * s->n_expert, cudaHostAllocMapped),
       "cudaHostAlloc(logits)");
    CK(cudaHostGetDevicePointer((void **)&c->logits_host_dev, c->logits_host, 0),
       "cudaHostGetDevicePointer(logits)");
    CK(cudaMalloc((void **)&c->logits_dev, sizeof(float) * s->n_expert), "cudaMalloc(logits)");
    CK(cudaHostAlloc((void **)&c->kroute, sizeof *c->kroute, cudaHostAllocMapped),
       "cudaHostAlloc(route)");
    CK(cudaHostGetDevicePointer((void **)&c->kroute_dev, c->kroute, 0),
       "cudaHostGetDevicePointer(route)");
    memset(c->kroute, 0, sizeof *c->kroute); /* no routing numbered 0 is ever queued */
    CK(cudaHostAlloc((void **)&c->forced, sizeof *c->forced, cudaHostAllocMapped),
       "cudaHostAlloc(forced)");
    CK(cudaHostGetDevicePointer((void **)&c->forced_dev, c->forced, 0),
       "cudaHostGetDevicePointer(forced)");
    CK(cudaMalloc((void **)&c->tab_dev, sizeof *c->tab_dev), "cudaMalloc(tab)");
    CK(cudaMalloc((void **)&c->ttab_dev, sizeof *c->ttab_dev), "cudaMalloc(ttab)");
    CK(cudaMemset(c->ttab_dev, 0, sizeof *c->ttab_dev), "cudaMemset(ttab)"); /* tag 0: none */
    for (int i = 0; i < 2; i++) { /* zeroed once: k_quant_x_img never writes the padding */
        CK(cudaMalloc((void **)&c->ximg[i], k_gu4_xbytes(s->dim)), "cudaMalloc(ximg)");
        CK(cudaMemset(c->ximg[i], 0, k_gu4_xbytes(s->dim)), "cudaMemset(ximg)");
    }
    CK(cudaEventCreateWithFlags(&c->ev_picks, cudaEventDisableTiming), "cudaEventCreate(picks)");
    return prepare_kernels(c, err);
}

extern "C" int sl_gpu_open(sl_gpu_ctx **out, int dev, const sl_moe_shape *s, sl_err *err)
{
    if (!out || !s) return sl_err_set(err, SL_EINVAL, "sl_gpu_open: NULL argument");
    *out = NULL;
    if (s->dim == 0 || s->dim % 256 || s->dim > 12288 || s->inter == 0 || s->inter % 256 ||
        s->inter > 4608 || s->n_used == 0 || s->n_used > SL_GPU_MAX_USED || s->n_expert == 0 ||
        s->n_expert > 1024 || s->n_used > s->n_expert)
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
                   dn_chunks = (4 * (s->inter / 256 * 110) + 30) / 16; /* raw, staged */
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
    if (c->copy) cudaStreamSynchronize(c->copy);
    free_scratch(&c->rs);
    free_scratch(&c->ss);
    cudaFree(c->y_sh);
    cudaFree(c->ys);
    for (int i = 0; i < PK_RING; i++) {
        cudaFree(c->pk[i].buf);
        if (c->pk[i].done) cudaEventDestroy(c->pk[i].done);
    }
    cudaFreeHost(c->logits_host);
    cudaFree(c->logits_dev);
    cudaFreeHost(c->kroute);
    cudaFreeHost(c->forced);
    cudaFree(c->tab_dev);
    cudaFree(c->ttab_dev);
    cudaFree(c->ximg[0]);
    cudaFree(c->ximg[1]);
    if (c->ev_picks) cudaEventDestroy(c->ev_picks);
    if (c->ev_in) cudaEventDestroy(c->ev_in);
    if (c->ev_sh) cudaEventDestroy(c->ev_sh);
    if (c->ev_logits) cudaEventDestroy(c->ev_logits);
    for (uint32_t i = 0; c->marks && i < SL_GPU_MARKS; i++)
        if (c->marks[i]) cudaEventDestroy(c->marks[i]);
    free(c->marks);
    if (c->main) cudaStreamDestroy(c->main);
    if (c->side) cudaStreamDestroy(c->side);
    if (c->copy) cudaStreamDestroy(c->copy);
    if (c->ev_copy) cudaEventDestroy(c->ev_copy);
    if (c->ev_fence) cudaEventDestroy(c->ev_fence);
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
    CK(join_copies(c), "tile the downs copied so far");
    CK(cudaStreamSynchronize(c->side), "cudaStreamSynchronize(side)");
    CK(cudaStreamSynchronize(c->copy), "cudaStreamSynchronize(copy)");
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

extern "C" int sl_gpu_residual_norm(sl_gpu_ctx *c, uint16_t *h, const uint16_t *y, const float *w,
                                    float eps, uint16_t *x, sl_err *err)
{
    if (!c || !h || (w && !x))
        return sl_err_set(err, SL_EINVAL, "sl_gpu_residual_norm: NULL argument");
    const uint32_t dim = c->shape.dim;
    if (dim % SL_EMU_NORM_LANES)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_residual_norm: dim %u is not a multiple of %d",
                          dim, SL_EMU_NORM_LANES);
    CK(launch_norm(c, h, y, h, w, eps, x), "k_residual_norm");
    return 0;
}

extern "C" int sl_gpu_embed_q2_k(sl_gpu_ctx *c, const void *table, uint32_t row, uint16_t *h,
                                 sl_err *err)
{
    if (!c || !table || !h) return sl_err_set(err, SL_EINVAL, "sl_gpu_embed_q2_k: NULL argument");
    const uint32_t dim = c->shape.dim;
    if (dim % 256)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_embed_q2_k: dim %u is not a multiple of 256",
                          dim);
    k_embed_q2_k<<<(dim + 255) / 256, 256, 0, c->main>>>((const uint8_t *)table, row, dim, h);
    CK_LAUNCH("k_embed_q2_k");
    return 0;
}

extern "C" int sl_gpu_router_start(sl_gpu_ctx *c, const uint16_t *x, const uint16_t *w, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_router_start: NULL context");
    if (check_ptr(x, "sl_gpu_router_start: x", err) || check_ptr(w, "sl_gpu_router_start: w", err))
        return SL_EINVAL;
    /* The kernel writes the logits straight into pinned host memory (mapped): no copy
     * to queue and wait for; the event after it says they have all landed. */
    CK(launch_router(c, x, w, c->logits_host_dev, NULL), "k_router");
    CK(cudaEventRecord(c->ev_logits, c->main), "cudaEventRecord(logits)");
    c->router_pending = 1;
    return 0;
}

extern "C" int sl_gpu_router_wait(sl_gpu_ctx *c, float *logits, sl_err *err)
{
    if (!c || !logits) return sl_err_set(err, SL_EINVAL, "sl_gpu_router_wait: NULL argument");
    if (!c->router_pending)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_router_wait: no sl_gpu_router_start");
    c->router_pending = 0;
    CK(cudaEventSynchronize(c->ev_logits), "cudaEventSynchronize(logits)");
    memcpy(logits, c->logits_host, sizeof(float) * c->shape.n_expert);
    return 0;
}

extern "C" int sl_gpu_router_logits(sl_gpu_ctx *c, const uint16_t *x, const uint16_t *w,
                                    float *logits, sl_err *err)
{
    if (!logits) return sl_err_set(err, SL_EINVAL, "sl_gpu_router_logits: NULL argument");
    int rc = sl_gpu_router_start(c, x, w, err);
    return rc ? rc : sl_gpu_router_wait(c, logits, err);
}

extern "C" int sl_gpu_t0_set(sl_gpu_ctx *c, sl_gpu_t0e *table, const uint32_t *index,
                             const sl_gpu_t0e *value, uint32_t n, sl_err *err)
{
    sl_kt0set set;
    if (!c || !table || (n && (!index || !value)) || n > 16)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_t0_set: bad arguments (n %u)", n);
    if (!n) return 0;
    for (uint32_t i = 0; i < n; i++) /* an entry is empty (gate NULL) or three aligned parts */
        if (value[i].gate && (check_ptr(value[i].gate, "sl_gpu_t0_set: gate", err) ||
                              check_ptr(value[i].up, "sl_gpu_t0_set: up", err) ||
                              check_ptr(value[i].down, "sl_gpu_t0_set: down", err)))
            return SL_EINVAL;
    memset(&set, 0, sizeof set);
    set.n = n;
    for (uint32_t i = 0; i < n; i++) {
        set.index[i] = index[i];
        set.value[i] = value[i];
    }
    k_t0_set<<<1, 32, 0, c->main>>>(table, set);
    CK_LAUNCH("k_t0_set");
    return 0;
}

/* The selection kernel on logits_dev, writing kroute and (t0) tab_dev. It reads the
 * device tier's entries before its wait for the router: right after launch_router (no
 * kernel or stream operation between them), whose every CTA waits for the kernel
 * before it (k_t0_set's updates, the norm) before it lets the selection start. */
static cudaError_t launch_select(sl_gpu_ctx *c, const float *bias, const sl_gpu_t0e *t0,
                                 const sl_moe_route *forced, int with_sh)
{
    c->route_seq++;
    c->ttab_tag = c->ttab_tag % 15 + 1; /* 0 (the zeroed table) never: sl_kttab */
    const sl_moe_shape *s = &c->shape;
    const uint32_t threads = (s->n_expert + 31) / 32 * 32; /* <= 1024, checked at open */
    return k_launch(k_route_select, 1, threads, 0, c->main, USE_PDL, (const float *)c->logits_dev,
                    bias, s->n_expert, s->n_used, s->norm_topk, s->route_scale, t0, forced,
                    c->kroute_dev, c->tab_dev, c->sh, with_sh, c->route_seq, c->ttab_dev,
                    c->ttab_tag, c->rt_stamps);
}

/* The q8_1 of h that a probe's qh_form gives a bulk-copy gate/up whose own form is dflt
 * (gpu.h, sl_gpu_probe: 0 keeps dflt, 1 none (k_quant_h after it), 3 or 4 that form). */
static int qh_of_probe(int qh_form, int dflt)
{
    return qh_form == 1 ? 0 : qh_form >= 3 ? qh_form : dflt;
}

extern "C" int sl_gpu_set_probe(sl_gpu_ctx *c, const sl_gpu_probe *p, sl_err *err)
{
    if (!c || !p) return sl_err_set(err, SL_EINVAL, "sl_gpu_set_probe: NULL argument");
    if (c->in_token || c->route_pending)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_set_probe: a token is in flight");
    if (p->qh_form != 0 && p->qh_form != 1 && p->qh_form != 3 && p->qh_form != 4)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_set_probe: qh_form %d (0, 1, 3 or 4)",
                          p->qh_form);
    if (p->gu_stamps || p->dn_stamps) { /* the most (CTA, group) records a launch writes */
        const uint32_t gu =
            (uint32_t)(c->gt_occ > c->gtd_occ ? c->gt_occ : c->gtd_occ) * (uint32_t)c->n_sm * GT_NG;
        uint32_t dn = 0;
        for (int n = 1; n <= SL_GPU_MAX_USED; n++)
            if (dp_grid(c, n) * DP_NG > dn) dn = dp_grid(c, n) * DP_NG;
        if ((p->gu_stamps && gu > p->records) || (p->dn_stamps && dn > p->records))
            return sl_err_set(err, SL_EINVAL,
                              "sl_gpu_set_probe: %u records, the kernels may write %u (gate/up) "
                              "and %u (down)",
                              p->records, gu, dn);
    }
    c->gt_stg = GT_STG && !p->plain_start;
    c->gtd_flag = !p->wait_select;
    c->gt_qh = qh_of_probe(p->qh_form, GT_QH);
    c->gtd_qh = qh_of_probe(p->qh_form, GTD_QH);
    c->rs.stamps = p->gu_stamps;
    c->dn_stamps = p->dn_stamps;
    c->rt_stamps = p->rt_stamps;
    return 0;
}

/* The selection's picks (mapped memory, complete) into route, zero past n_used. */
static void read_picks(const sl_gpu_ctx *c, sl_moe_route *route)
{
    memset(route, 0, sizeof *route);
    for (uint32_t r = 0; r < c->shape.n_used; r++) {
        route->expert[r] = c->kroute->expert[r];
        route->weight[r] = c->kroute->weight[r];
    }
}

/* sl_gpu_route_start, with x computed by the router first when nm is given
 * (sl_gpu_route_start_norm, whose checks are done). */
static int route_start(sl_gpu_ctx *c, const uint16_t *x, const uint16_t *w, const float *bias,
                       const sl_gpu_t0e *t0, const sl_moe_route *forced, const k_rnorm *nm,
                       sl_err *err)
{
    if (c->route_pending || c->in_token)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_route_start: the last token is not finished");
    const sl_moe_shape *s = &c->shape;
    if (forced) { /* the last selection has completed (its wait): the buffer is free */
        for (uint32_t r = 0; r < s->n_used; r++)
            if (forced->expert[r] >= s->n_expert)
                return sl_err_set(err, SL_EINVAL, "sl_gpu_route_start: forced expert %u of %u",
                                  forced->expert[r], s->n_expert);
        *c->forced = *forced;
    }
    if (!c->gtd_ok) t0 = NULL; /* the device tier's kernel does not fit: the host queues all */
    CK(join_copies(c), "wait for the copies");
    CK(launch_router(c, x, w, c->logits_dev, t0 ? c->ximg[0] : NULL, nm), "k_router_pf");
    const int with_sh = t0 && c->sh_state == SH_MERGE && c->sh_x == x;
    CK(launch_select(c, bias, t0, forced ? c->forced_dev : NULL, with_sh), "k_route_select");
    if (with_sh) c->sh_state = SH_MERGED;
    if (t0) { /* right after the selection (PDL): the shared expert's rows load meanwhile */
        const uint32_t grid =
            gt_grid(c, (s->n_used + (uint32_t)with_sh) * (s->inter / GT_TR), c->gtd_occ, c->gtd_qh);
        CK(k_launch(gtd_kernel(c->rs.stamps != NULL, c->gtd_qh, s->dim), grid, GT_THREADS,
                    gt_smem(s->dim), c->main, USE_PDL, (const sl_ktab *)c->tab_dev,
                    (const uint8_t *)c->ximg[0], s->dim, s->inter, s->swiglu_limit, c->rs, c->sh,
                    with_sh, (const sl_kttab *)(c->gtd_flag ? c->ttab_dev : NULL), c->ttab_tag),
           "k_gateup_tma_dev_q2_k");
    }
    /* the watchdog of sl_gpu_route_wait's spin; after the gate/up, since a stream
     * operation between the selection and the gate/up would undo their overlap (PDL) */
    CK(cudaEventRecord(c->ev_picks, c->main), "cudaEventRecord(picks)");
    c->route_pending = 1;
    c->route_x = x;
    return 0;
}

extern "C" int sl_gpu_route_start(sl_gpu_ctx *c, const uint16_t *x, const uint16_t *w,
                                  const float *bias, const sl_gpu_t0e *t0,
                                  const sl_moe_route *forced, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_route_start: NULL context");
    if (check_ptr(x, "sl_gpu_route_start: x", err) || check_ptr(w, "sl_gpu_route_start: w", err))
        return SL_EINVAL;
    return route_start(c, x, w, bias, t0, forced, NULL, err);
}

extern "C" int sl_gpu_route_start_norm(sl_gpu_ctx *c, const sl_gpu_norm *n, uint16_t *x,
                                       const uint16_t *w, const float *bias, const sl_gpu_t0e *t0,
                                       const sl_moe_route *forced, sl_err *err)
{
    if (!c || !n) return sl_err_set(err, SL_EINVAL, "sl_gpu_route_start_norm: NULL argument");
    if (check_ptr(x, "sl_gpu_route_start_norm: x", err) ||
        check_ptr(w, "sl_gpu_route_start_norm: w", err) ||
        check_ptr(n->h, "sl_gpu_route_start_norm: h", err) ||
        check_ptr(n->w, "sl_gpu_route_start_norm: norm weights", err) ||
        (n->y && (check_ptr(n->y, "sl_gpu_route_start_norm: y", err) ||
                  check_ptr(n->h_out, "sl_gpu_route_start_norm: h_out", err))))
        return SL_EINVAL;
    if (n->y && n->h_out == n->h)
        return sl_err_set(err, SL_EINVAL,
                          "sl_gpu_route_start_norm: h_out is h (every router CTA reads h)");
    if (c->shape.dim % SL_EMU_NORM_LANES)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_route_start_norm: dim %u is not a multiple of %d",
                          c->shape.dim, SL_EMU_NORM_LANES);
    if (c->sh_state == SH_SIDE)
        return sl_err_set(err, SL_EINVAL,
                          "sl_gpu_route_start_norm: the shared expert was queued on the side "
                          "stream, reading x before it is computed (sl_gpu_moe_shared_merges)");
    const k_rnorm nm = {n->h, n->y, n->h_out, x, n->w, n->eps};
    return route_start(c, x, w, bias, t0, forced, &nm, err);
}

extern "C" int sl_gpu_route_wait(sl_gpu_ctx *c, sl_moe_route *route, uint32_t *started, sl_err *err)
{
    if (!c || !route || !started)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_route_wait: NULL argument");
    if (!c->route_pending)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_route_wait: no sl_gpu_route_start");
    c->route_pending = 0;
    /* The selection writes its number last (after a system fence): spinning on it sees
     * the picks microseconds sooner than an event would; the event, asked now and then,
     * catches a kernel that never wrote it. */
    for (uint32_t spins = 1;; spins++) {
        if (__atomic_load_n(&c->kroute->seq, __ATOMIC_ACQUIRE) == c->route_seq) break;
        if (spins % 64 == 0) sched_yield(); /* e.g. to ZeroMQ's I/O thread on this CPU (--cpu) */
        if (spins % 1024) continue;
        const cudaError_t q = cudaEventQuery(c->ev_picks);
        if (q == cudaErrorNotReady) continue;
        CK(q, "cudaEventQuery(picks)");
        if (__atomic_load_n(&c->kroute->seq, __ATOMIC_ACQUIRE) != c->route_seq)
            return sl_err_set(err, SL_EIO, "sl_gpu_route_wait: the selection wrote no picks");
        break;
    }
    const uint32_t n = c->shape.n_used;
    read_picks(c, route);
    *started = c->kroute->started;
    int rc = sl_gpu_moe_begin(c, c->route_x, route, err);
    if (rc) return rc;
    for (uint32_t r = 0; r < n; r++)
        if (*started >> r & 1) {
            const uint32_t slot = c->slot_of[r];
            c->all.e[slot] = c->kroute->e[slot];
            note_down(c, slot);
            if (c->gtd_qh) c->qh_done |= 1u << slot; /* the device-table gate/up's */
        }
    if (c->sh_state == SH_MERGED && c->gtd_qh) c->qh_done |= 1u << n; /* it rode there too */
    c->queued = *started;
    return 0;
}

extern "C" int sl_gpu_select(sl_gpu_ctx *c, const float *logits, const float *bias,
                             sl_moe_route *route, sl_err *err)
{
    if (!c || !logits || !route) return sl_err_set(err, SL_EINVAL, "sl_gpu_select: NULL argument");
    if (c->route_pending || c->in_token)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_select: a token is in flight");
    const sl_moe_shape *s = &c->shape;
    CK(cudaMemcpyAsync(c->logits_dev, logits, sizeof(float) * s->n_expert, cudaMemcpyHostToDevice,
                       c->main),
       "cudaMemcpyAsync(logits)");
    CK(launch_select(c, bias, NULL, NULL, 0), "k_route_select");
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(select)");
    read_picks(c, route);
    return 0;
}

/* Where the shared expert's parts live: gate and up both in device memory (gu_dev),
 * the down there (down_dev). */
struct sh_place {
    bool gu_dev, down_dev;
};

static sh_place shared_place(const sl_moe_expert_w *sh)
{
    return {!in_host(sh->gate) && !in_host(sh->up), !in_host(sh->down)};
}

/* Whether the shared expert rides in the routed launches (K-quant, in device memory,
 * a free table slot, the bulk-copy kernels available) or runs on the side stream. */
static bool shared_merges(const sl_gpu_ctx *c, sh_place p)
{
    return !c->sh_bf16 && c->shape.n_used < SL_GPU_MAX_USED && c->gt_ok && c->dt_ok && p.gu_dev &&
           p.down_dev;
}

extern "C" int sl_gpu_moe_shared_merges(const sl_gpu_ctx *c, const sl_moe_expert_w *sh)
{
    return c && sh && sh->gate && sh->up && sh->down && shared_merges(c, shared_place(sh));
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
    tab.e[0].slot = 0;
    const sh_place pl = shared_place(sh);
    tab.pk = !c->sh_bf16 && pl.down_dev;
    if (shared_merges(c, pl)) {
        c->sh = tab.e[0];
        c->sh.slot = (int)s->n_used;
        c->sh_x = x;
        c->sh_state = SH_MERGE;
        return 0;
    }
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
        const bool gt = c->gt_ok && pl.gu_dev;
        const bool dt = c->dt_ok && pl.down_dev;
        bool wrote_qh;
        CK(launch_gateup(c, tab, x, c->ss, c->side, gt, false, &wrote_qh), "gate/up (shared)");
        CK(launch_quant_h(c, c->ss, 1, wrote_qh ? 0u : ~0u, c->side, false), "k_quant_h (shared)");
        CK(launch_down(c, tab, c->ss, NULL, c->y_sh, NULL, c->side, dt, USE_PDL && dt),
           "down (shared)");
    }
    CK(cudaEventRecord(c->ev_sh, c->side), "cudaEventRecord(shared)");
    c->sh_state = SH_SIDE;
    return 0;
}

extern "C" int sl_gpu_moe_begin(sl_gpu_ctx *c, const uint16_t *x, const sl_moe_route *route,
                                sl_err *err)
{
    if (!c || !route) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_begin: NULL argument");
    if (check_ptr(x, "sl_gpu_moe_begin: x", err)) return SL_EINVAL;
    const uint32_t n = c->shape.n_used;
    uint32_t order[64];
    sl_emu_moe_order(route, n, order);
    c->x = x;
    c->route = *route;
    for (uint32_t k = 0; k < n; k++) c->slot_of[order[k]] = k;
    memset(&c->all, 0, sizeof c->all);
    c->all.n = (int)n;
    c->queued = 0;
    c->down_host = 0;
    c->early = 0;
    c->qh_done = 0;
    c->in_token = 1;
    return 0;
}

extern "C" int sl_gpu_moe_part(sl_gpu_ctx *c, const uint32_t *ranks, uint32_t nr,
                               const sl_moe_expert_w *w, sl_err *err)
{
    if (!c || (nr && (!ranks || !w)))
        return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_part: NULL argument");
    if (!c->in_token) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_part: no sl_gpu_moe_begin");
    const uint32_t n = c->shape.n_used;
    sl_ktab tab[2]; /* [0] device weights (bulk copies), [1] host-mapped weights */
    memset(tab, 0, sizeof tab);
    uint32_t mask = 0;
    for (uint32_t i = 0; i < nr; i++) {
        const uint32_t r = ranks[i];
        if (r >= n || ((c->queued | mask) >> r & 1))
            return sl_err_set(err, SL_EINVAL,
                              "sl_gpu_moe_part: rank %u out of range or queued twice", r);
        const sl_moe_expert_w *e = &w[r];
        char what[64];
        snprintf(what, sizeof what, "sl_gpu_moe_part: expert %u", c->route.expert[r]);
        if (check_ptr(e->gate, what, err) || check_ptr(e->up, what, err) ||
            check_ptr(e->down, what, err))
            return SL_EINVAL;
        mask |= 1u << r;
        const int host = !c->gt_ok || in_host(e->gate) || in_host(e->up);
        sl_kexp *k = &tab[host].e[tab[host].n++];
        k->gate = (const uint8_t *)e->gate;
        k->up = (const uint8_t *)e->up;
        k->down = (const uint8_t *)e->down;
        k->w = c->route.weight[r];
        k->slot = (int)c->slot_of[r];
        c->all.e[k->slot] = *k;
        note_down(c, (uint32_t)k->slot);
    }
    c->queued |= mask;
    CK(join_copies(c), "wait for the copies");
    if (c->sh_state == SH_MERGE && c->sh_x == c->x) { /* rides with the first launch */
        tab[0].e[tab[0].n++] = c->sh;
        c->sh_state = SH_MERGED;
    }
    bool wrote_qh = false; /* by the bulk-copy launch, tab[0] */
    for (int h = 0; h < 2; h++)
        if (tab[h].n)
            CK(launch_gateup(c, tab[h], c->x, c->rs, c->main, h == 0, USE_PDL && h == 0,
                             h ? NULL : &wrote_qh),
               h ? "k_gateup_q2_k" : "k_gateup_tma_q2_k");
    if (wrote_qh)
        for (int i = 0; i < tab[0].n; i++) c->qh_done |= 1u << tab[0].e[i].slot;
    return 0;
}

extern "C" int sl_gpu_moe_finish(sl_gpu_ctx *c, uint16_t *out, float *out_f32, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_finish: NULL context");
    if (check_ptr(out, "sl_gpu_moe_finish: out", err)) return SL_EINVAL;
    if (out_f32 && ((uintptr_t)out_f32 & 3))
        return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_finish: out_f32 %p misaligned", out_f32);
    const uint32_t n = c->shape.n_used;
    if (!c->in_token || c->queued != (1u << n) - 1)
        return sl_err_set(err, SL_EINVAL,
                          "sl_gpu_moe_finish: ranks queued 0x%x of %u (or no sl_gpu_moe_begin)",
                          c->queued, n);
    c->in_token = 0;
    const float *extra = NULL;
    bool pdl_q = USE_PDL;
    uint32_t nq = n; /* experts in the down launch */
    c->last_merged = 0;
    if (c->sh_state == SH_SIDE) {
        /* the event wait sits between gate/up and q8_1 of h: q8_1 then waits in full */
        CK(cudaStreamWaitEvent(c->main, c->ev_sh, 0), "cudaStreamWaitEvent(main, shared)");
        extra = c->y_sh;
        pdl_q = false;
    } else if (c->sh_state == SH_MERGE || c->sh_state == SH_MERGED) {
        if (c->sh_state == SH_MERGE) { /* no launch took it along (another x, or none) */
            sl_ktab one;
            memset(&one, 0, sizeof one);
            one.n = 1;
            one.e[0] = c->sh;
            bool wrote_qh;
            CK(launch_gateup(c, one, c->sh_x, c->rs, c->main, true, USE_PDL, &wrote_qh),
               "k_gateup_tma_q2_k (shared)");
            if (wrote_qh) c->qh_done |= 1u << n;
        } /* else the launch it rode with said whether it wrote its q8_1 (qh_done) */
        merge_shared(c);
        c->all.n = (int)n + 1;
        nq = n + 1;
        c->last_merged = 1;
    }
    c->sh_state = SH_NONE;
    CK(join_copies(c), "wait for the copies");
    if (c->early) { /* the rest's down apart too, then the sum of every slot in order */
        const uint32_t rest = ((1u << nq) - 1) & ~c->early;
        if (rest) { /* tiled (device memory) and raw (host memory) downs apart */
            CK(launch_quant_h(c, c->rs, nq, rest & ~c->qh_done, c->main, pdl_q),
               "k_quant_h (rest)");
            const uint32_t by[2] = {rest & c->all.pk, rest & ~c->all.pk};
            for (int k = 0; k < 2; k++)
                if (by[k])
                    CK(launch_down(c, slots_tab(c, by[k]), c->rs, NULL, NULL, NULL, c->main, true,
                                   USE_PDL, c->ys),
                       k ? "k_down_pt_q3_k (rest in host memory, apart)"
                         : "k_down_pt_q3_k (rest, apart)");
        }
        CK(k_launch(k_combine, (c->shape.dim + 255) / 256, 256, 0, c->main, USE_PDL && rest,
                    (const float *)c->ys, nq, c->shape.dim, extra, out_f32, out),
           "k_combine");
    } else {
        CK(launch_quant_h(c, c->rs, nq, ~c->qh_done, c->main, pdl_q), "k_quant_h");
        const bool dt = !c->down_host;
        CK(launch_down(c, c->all, c->rs, extra, out_f32, out, c->main, dt, USE_PDL && dt),
           dt ? "k_down_pt_q3_k" : "k_down2_q3_k");
    }
    c->n_last = n;
    CK(cudaEventRecord(c->ev_fence, c->main), "cudaEventRecord(fence)");
    c->fence_new = 1;
    return 0;
}

extern "C" int sl_gpu_moe_abort(sl_gpu_ctx *c, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_abort: NULL context");
    const int rc = sl_gpu_sync(c, err);
    c->in_token = 0;
    c->route_pending = 0; /* the next routing has a new number (route_seq) */
    c->queued = 0;
    c->early = 0;
    c->down_host = 0;
    c->sh_state = SH_NONE;
    return rc;
}

extern "C" int sl_gpu_moe_down_early(sl_gpu_ctx *c, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_down_early: NULL context");
    if (!c->in_token)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_down_early: no sl_gpu_moe_begin");
    if (c->down_host || !c->dt_ok) return 0; /* the register-staged down sums in one go */
    const uint32_t n = c->shape.n_used;
    uint32_t done = 0; /* slots whose gate/up is queued */
    for (uint32_t r = 0; r < n; r++)
        if (c->queued >> r & 1) done |= 1u << c->slot_of[r];
    if (c->sh_state == SH_MERGED) { /* qh_done says whether its launch wrote its q8_1 */
        done |= 1u << n;
        merge_shared(c);
    }
    const uint32_t now = done & ~c->early;
    if (!now) return 0;
    CK(launch_quant_h(c, c->rs, n + 1, now & ~c->qh_done, c->main, USE_PDL), "k_quant_h (early)");
    CK(launch_down(c, slots_tab(c, now), c->rs, NULL, NULL, NULL, c->main, true, USE_PDL, c->ys),
       "k_down_pt_q3_k (early, apart)");
    c->early |= now;
    return 0;
}

extern "C" int sl_gpu_moe_routed(sl_gpu_ctx *c, const uint16_t *x, const sl_moe_route *route,
                                 const sl_moe_expert_w *w, uint16_t *out, float *out_f32,
                                 sl_err *err)
{
    if (!c || !route || !w) return sl_err_set(err, SL_EINVAL, "sl_gpu_moe_routed: NULL argument");
    if (check_ptr(x, "sl_gpu_moe_routed: x", err) || check_ptr(out, "sl_gpu_moe_routed: out", err))
        return SL_EINVAL;
    uint32_t ranks[SL_GPU_MAX_USED];
    for (uint32_t k = 0; k < c->shape.n_used; k++) ranks[k] = k;
    int rc = sl_gpu_moe_begin(c, x, route, err);
    if (!rc) rc = sl_gpu_moe_part(c, ranks, c->shape.n_used, w, err);
    if (rc) {
        c->in_token = 0;
        return rc;
    }
    return sl_gpu_moe_finish(c, out, out_f32, err);
}

extern "C" int sl_gpu_upload_async(sl_gpu_ctx *c, void *dev, const void *host, size_t bytes,
                                   sl_err *err)
{
    if (!c || !dev || !host)
        return sl_err_set(err, SL_EINVAL, "sl_gpu_upload_async: NULL argument");
    if (c->fence_new) { /* device memory read by the last token's work is free then */
        CK(cudaStreamWaitEvent(c->copy, c->ev_fence, 0), "cudaStreamWaitEvent(copy, fence)");
        c->fence_new = 0;
    }
    CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, c->copy),
       "cudaMemcpyAsync(upload_async)");
    c->copies_pending = 1;
    return 0;
}

extern "C" uint64_t sl_gpu_packed_bytes(uint64_t raw_bytes)
{
    return raw_bytes / 110 * (SL_Q3K_TB / 8);
}

/* Raw bytes of one 8-row tile of the context's down rows (inter / 256 blocks a row): the
 * unit the tiled layout takes. */
static uint64_t down_tile_bytes(const sl_gpu_ctx *c)
{
    return 8ull * (c->shape.inter / 256) * 110;
}

/* The checks of both uploads of a Q3_K down (rows of the context's inter). */
static int check_down(const sl_gpu_ctx *c, const void *dev, const void *host, uint64_t raw_bytes,
                      const char *fn, sl_err *err)
{
    if (!dev || !host) return sl_err_set(err, SL_EINVAL, "%s: NULL argument", fn);
    if (!raw_bytes || raw_bytes % 110)
        return sl_err_set(err, SL_EINVAL, "%s: %llu bytes are not whole Q3_K blocks (110 each)", fn,
                          (unsigned long long)raw_bytes);
    const uint64_t tile = down_tile_bytes(c);
    if (raw_bytes % tile)
        return sl_err_set(err, SL_EINVAL,
                          "%s: %llu bytes are not whole 8-row tiles of the context's down rows "
                          "(%llu bytes each)",
                          fn, (unsigned long long)raw_bytes, (unsigned long long)tile);
    if ((uintptr_t)dev & 15)
        return sl_err_set(err, SL_EINVAL, "%s: device address %p is not 16-byte aligned", fn, dev);
    return 0;
}

/* The async upload without its checks: raw_bytes <= c->pk_cap. */
static int upload_down(sl_gpu_ctx *c, void *dev, const void *host, uint64_t raw_bytes, sl_err *err)
{
    if (c->n_pk_wait == PK_RING) CK(join_copies(c), "tile the downs copied so far");
    const uint32_t r = c->pk_next % PK_RING; /* not waiting: the waiting ones are the last */
    if (c->pk[r].recorded)                   /* its last tiling has read it */
        CK(cudaStreamWaitEvent(c->copy, c->pk[r].done, 0), "cudaStreamWaitEvent(copy, tile)");
    const int rc = sl_gpu_upload_async(c, c->pk[r].buf, host, raw_bytes, err);
    if (rc) return rc;
    c->pk_wait[c->n_pk_wait].ring = r;
    c->pk_wait[c->n_pk_wait].dst = (uint8_t *)dev;
    c->pk_wait[c->n_pk_wait].n = raw_bytes / down_tile_bytes(c);
    c->n_pk_wait++;
    c->pk_next++;
    return 0;
}

extern "C" int sl_gpu_upload_down_async(sl_gpu_ctx *c, void *dev, const void *host,
                                        uint64_t raw_bytes, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_upload_down_async: NULL context");
    int rc = check_down(c, dev, host, raw_bytes, "sl_gpu_upload_down_async", err);
    if (rc) return rc;
    if (raw_bytes > c->pk_cap)
        return sl_err_set(err, SL_EINVAL,
                          "sl_gpu_upload_down_async: %llu bytes, more than a down of the "
                          "context's shape (%llu; sl_gpu_upload_down takes any size)",
                          (unsigned long long)raw_bytes, (unsigned long long)c->pk_cap);
    return upload_down(c, dev, host, raw_bytes, err);
}

extern "C" int sl_gpu_upload_down(sl_gpu_ctx *c, void *dev, const void *host, uint64_t raw_bytes,
                                  sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_upload_down: NULL context");
    int rc = check_down(c, dev, host, raw_bytes, "sl_gpu_upload_down", err);
    if (rc) return rc;
    const uint64_t tile = down_tile_bytes(c);
    const uint64_t n = raw_bytes / tile, per = c->pk_cap / tile; /* tiles: all, a stage's */
    for (uint64_t t = 0; t < n && !rc; t += per)                 /* a stage's worth at a time */
        rc = upload_down(c, (uint8_t *)dev + sl_gpu_packed_bytes(t * tile),
                         (const uint8_t *)host + t * tile, (n - t < per ? n - t : per) * tile, err);
    if (rc) return rc;
    CK(join_copies(c), "tile the down");
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(upload_down)");
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
        CK(cudaMemcpy(h_sh, c->last_merged ? c->rs.h + n * inter : c->ss.h, sizeof(float) * inter,
                      cudaMemcpyDeviceToHost),
           "peek(h_sh)");
    if (y_sh && c->last_merged) /* its down output went straight into the sum */
        for (uint32_t i = 0; i < c->shape.dim; i++) y_sh[i] = NAN;
    else if (y_sh)
        CK(cudaMemcpy(y_sh, c->y_sh, sizeof(float) * c->shape.dim, cudaMemcpyDeviceToHost),
           "peek(y_sh)");
    return 0;
}

/* ---- timeline marks ---- */

static uint64_t host_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

extern "C" int sl_gpu_mark_anchor(sl_gpu_ctx *c, sl_err *err)
{
    if (!c) return sl_err_set(err, SL_EINVAL, "sl_gpu_mark_anchor: NULL context");
    if (!c->marks) {
        c->marks = (cudaEvent_t *)calloc(SL_GPU_MARKS, sizeof *c->marks);
        if (!c->marks) return sl_err_set(err, SL_ENOMEM, "sl_gpu_mark_anchor: out of memory");
        for (uint32_t i = 0; i < SL_GPU_MARKS; i++)
            CK(cudaEventCreate(&c->marks[i]), "cudaEventCreate(mark)");
    }
    /* On an idle stream the anchor completes at once: its host time is taken right
     * after, so every later mark is placed on the host clock to within the latency of
     * one event (microseconds). */
    CK(cudaStreamSynchronize(c->main), "cudaStreamSynchronize(anchor)");
    CK(cudaEventRecord(c->marks[0], c->main), "cudaEventRecord(anchor)");
    CK(cudaEventSynchronize(c->marks[0]), "cudaEventSynchronize(anchor)");
    c->anchor_ns = host_now_ns();
    c->n_marks = 1;
    return 0;
}

static int mark_on(sl_gpu_ctx *c, cudaStream_t st, uint32_t *id, sl_err *err)
{
    if (!c || !id) return sl_err_set(err, SL_EINVAL, "sl_gpu_mark: NULL argument");
    if (!c->n_marks) return sl_err_set(err, SL_EINVAL, "sl_gpu_mark: no sl_gpu_mark_anchor");
    if (c->n_marks == SL_GPU_MARKS)
        return sl_err_set(err, SL_ENOMEM, "sl_gpu_mark: %d marks since the anchor", SL_GPU_MARKS);
    CK(cudaEventRecord(c->marks[c->n_marks], st), "cudaEventRecord(mark)");
    *id = c->n_marks++;
    return 0;
}

extern "C" int sl_gpu_mark(sl_gpu_ctx *c, uint32_t *id, sl_err *err)
{
    return mark_on(c, c ? c->main : NULL, id, err);
}

extern "C" int sl_gpu_mark_copy(sl_gpu_ctx *c, uint32_t *id, sl_err *err)
{
    return mark_on(c, c ? c->copy : NULL, id, err);
}

extern "C" int sl_gpu_marks_read(sl_gpu_ctx *c, uint64_t *ns, uint32_t *n, sl_err *err)
{
    if (!c || !ns || !n) return sl_err_set(err, SL_EINVAL, "sl_gpu_marks_read: NULL argument");
    uint32_t have = c->n_marks;
    *n = have;
    if (!have) return 0;
    ns[0] = c->anchor_ns;
    for (uint32_t i = 1; i < have; i++) {
        float ms = 0;
        /* marks sit on two streams: each is waited for (at once when complete) */
        CK(cudaEventSynchronize(c->marks[i]), "cudaEventSynchronize(mark)");
        CK(cudaEventElapsedTime(&ms, c->marks[0], c->marks[i]), "cudaEventElapsedTime(mark)");
        ns[i] = c->anchor_ns + (uint64_t)((double)ms * 1e6);
    }
    c->n_marks = 0;
    return 0;
}
