/* moe_sandbox.cuh - kernels bench-moe measures that compute/ does not ship.
 *
 * Kernel work starts here (STYLE: the sandbox first): each of these computes the
 * emulation's bits and lost to compute/'s form on the H200; bench-moe keeps measuring
 * them beside it, and the results files and docs/decisions.md say by how much and why.
 * They use compute/moe_kern.cuh's helpers and bodies (included first, in the same
 * anonymous namespace of this translation unit): the register-staged gate/up of 4 rows
 * a warp, the one-CTA-a-tile bulk-copy down, the register-staged down of 4 rows a step,
 * the down at other register counts or on the tensor cores, the down in one round, and
 * the fused layer kernel (gate/up, q8_1 of h and down in one launch).
 */
#ifndef SL_MOE_SANDBOX_CUH
#define SL_MOE_SANDBOX_CUH

#include "moe_kern.cuh"
#include "fused_plan.h"

/* What the fused layer kernel (k_moe_fused_q2q3) needs besides sl_kscratch. sync is
 * zero between launches (each launch leaves it so): [0, SL_GPU_MAX_USED) the q8_1
 * groups of h done per slot, [SL_GPU_MAX_USED] the CTAs finished, [SL_KFUSE_TILES..)
 * per output tile the experts whose rows are in part. */
#define SL_KFUSE_TILES 16
struct sl_kfuse {
    unsigned *sync;     /* [SL_KFUSE_TILES + dim / TD] */
    float *part;        /* [SL_GPU_MAX_USED][dim] each expert's bf16-rounded rows, by slot */
    const float *extra; /* added last, when the kernel sums (NULL: nothing) */
    float *out_f32;     /* [dim] the sum, when the kernel sums (NULL: not wanted) */
    uint16_t *out_bf16; /* [dim] the same rounded to bf16 (NULL: not wanted) */
    int n_all;          /* the token's experts: a table that holds them all is summed */
    unsigned long long *stamps; /* NULL, or [grid][4] %globaltimer ns of each CTA's thread 0
                                 * (bench): x landed, its group's gate/up done (its first
                                 * down unit), that unit's h copied, the CTA's end */
};

namespace
{

/* Queues the copy of the aligned chunks covering [p, p + bytes) to dst (one warp). */
__device__ __forceinline__ void k_span_async(int4 *dst, const uint8_t *p, uint32_t bytes, int lane)
{
    const int4 *src;
    const int cnt = k_span(p, bytes, &src);
    for (int k = lane; k < cnt; k += 32) k_cp16(dst + k, src + k);
}

/* Chunks of a span of two Q2_K rows (any 4-byte aligned start). */
__host__ __device__ inline uint32_t k_gu4_cap(uint32_t dim)
{
    return (2 * (dim / 256 * 84) + 12 + 15) / 16;
}

/* Gate and up (Q2_K) of every expert of the table, then SwiGLU into s.h (k_quant_h
 * follows). One warp step = rows r, r + 1 of gate and up of one expert (8 lanes a
 * row: lanes 0-7 gate r, 8-15 up r, 16-23 gate r+1, 24-31 up r+1), staged with
 * cp.async in ST per-warp stages (ST - 1 steps in flight while one computes); the x
 * quantization overlaps the first loads. Persistent: warps stride over n*inter/2. */
template <int NW, int ST, int MINB>
__global__ void __launch_bounds__(NW * 32, MINB)
    k_gateup4_q2_k(const __grid_constant__ sl_ktab tab, const uint16_t *__restrict__ x,
                   uint32_t dim, uint32_t inter, float limit, const __grid_constant__ sl_kscratch s)
{
    extern __shared__ int4 k_smem[];
    int8_t *aq = (int8_t *)k_smem;             /* [dim + dim/8] padded codes */
    float *ad = (float *)(aq + dim + dim / 8); /* [dim/32] */
    int *as = (int *)(ad + dim / 32);          /* [dim/16 + dim/128] padded sums */
    int4 *stage = k_smem + k_gu4_xbytes(dim) / 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t rb = dim / 256 * 84, nb = dim / 256, cap = k_gu4_cap(dim);
    int4 *ws = stage + (size_t)warp * ST * 2 * cap;
    const uint32_t half = inter / 2, units = (uint32_t)tab.n * half, stride = gridDim.x * NW;
    const uint32_t u0 = blockIdx.x * NW + warp;

    /* queues the two 2-row spans of unit u into stage st (an empty group past the end) */
    auto issue = [&](uint32_t u, int st) {
        if (u < units) {
            const uint32_t e = u / half, r = 2 * (u % half);
            int4 *dst = ws + (size_t)st * 2 * cap;
            k_span_async(dst, tab.e[e].gate + (size_t)r * rb, 2 * rb, lane);
            k_span_async(dst + cap, tab.e[e].up + (size_t)r * rb, 2 * rb, lane);
        }
        k_cp_commit();
    };
#pragma unroll
    for (int i = 0; i < ST - 1; i++) issue(u0 + i * stride, i);
    k_quant_x<NW, true>(x, dim, aq, ad, as);
    __syncthreads();

    const int t = lane >> 3, n = lane & 7;
    int st = 0;
    for (uint32_t u = u0; u < units; u += stride) {
        issue(u + (ST - 1) * stride, st == 0 ? ST - 1 : st - 1);
        k_cp_wait<ST - 1>();
        __syncwarp();
        const uint32_t e = u / half, r = 2 * (u % half);
        const uint8_t *src = (t & 1) ? tab.e[e].up : tab.e[e].gate;
        src += (size_t)r * rb;
        const uint8_t *row = (const uint8_t *)(ws + (size_t)st * 2 * cap + (t & 1) * cap) +
                             ((uintptr_t)src & 15) + (t >> 1) * rb;
        float a[4];
        k_dot4_q2_k(row, aq, ad, as, nb, n & 1, n >> 1, a);
        const float v = k_comb4(a);
        const float o = __shfl_xor_sync(~0u, v, 8); /* gate lanes get their up */
        if ((lane & 15) == 0)
            s.h[(size_t)tab.e[e].slot * inter + r + (lane >> 4)] =
                sl_emu_swiglu(v, o, tab.e[e].w, limit);
        __syncwarp();
        st = st + 1 == ST ? 0 : st + 1;
    }
}

/* Dynamic shared memory of k_gateup4_q2_k. */
inline size_t k_gateup4_smem(uint32_t dim, int nw, int st)
{
    return k_gu4_xbytes(dim) + (size_t)nw * st * 2 * k_gu4_cap(dim) * 16;
}
/* The four accumulators (groups 4j + s of every block, in increasing b) of lane j of
 * one Q3_K row (2 lanes a row; row 2-byte aligned in shared memory; the activation
 * read through L1). Each qs and hmask word is read once for its 4 shifts. The f32
 * order is sl_emu_dot_q3_k's: the 8-lane butterfly's xor 4 is the exchange between
 * the two lanes, its xor 2 and 1 are (t0 + t2) + (t1 + t3) inside (k_comb2). */
__device__ __forceinline__ void k_dot4_q3_k(const uint8_t *row, const int8_t *__restrict__ aq,
                                            const float *__restrict__ ad, uint32_t nb, int j,
                                            float (&acc)[4])
{
#pragma unroll
    for (int s = 0; s < 4; s++) acc[s] = 0.0f;
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 110 * b;
        uint32_t hm[8], qw[8], sw[3];
        k_ld8(blk, hm);
        k_ld8(blk + 32 + 32 * j, qw);
        k_ld3(blk + 96, sw);
#pragma unroll
        for (int w = 0; w < 8; w++) hm[w] = ~hm[w] >> (4 * j); /* bit s: group 4j+s is low */
        const float d = k_half(blk + 108);
        const float4 d8a = __ldg((const float4 *)(ad + 8 * b + 4 * j));
        const float d8[4] = {d8a.x, d8a.y, d8a.z, d8a.w};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int4 *aw = (const int4 *)(aq + 256 * b + 32 * (4 * j + s));
            const int4 a0 = __ldg(aw), a1 = __ldg(aw + 1);
            const int av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            int c0 = 0, c1 = 0;
#pragma unroll
            for (int w = 0; w < 8; w++) {
                const uint32_t lo = (qw[w] >> (2 * s)) & 0x03030303u;
                const uint32_t nh = (hm[w] >> s) & 0x01010101u;
                const int code = (int)(lo + nh * 0xFCu); /* bytes low - 4*(1 - hbit) */
                if (w < 4)
                    c0 = __dp4a(code, av[w], c0);
                else
                    c1 = __dp4a(code, av[w], c1);
            }
            /* scales k = 8j + 2s and k + 1: low nibbles in byte 2s (+1) at bit 4j, high
             * pairs in byte 8 + (2s & 3) (+1) at bit 2 * (2j + s/2) */
            const uint32_t lob = (sw[s >> 1] >> (16 * (s & 1) + 4 * j)) & 0x0F0Fu;
            const uint32_t hib = (sw[2] >> (8 * ((2 * s) & 3) + 2 * (2 * j + (s >> 1)))) & 0x0303u;
            const uint32_t sc = lob | hib << 4;
            const int s0 = (int)(sc & 63) - 32, s1 = (int)((sc >> 8) & 63) - 32;
            const float p = sl_emu_mul(d, k_i2f(s0 * c0 + s1 * c1));
            acc[s] = sl_emu_fma(d8[s], p, acc[s]);
        }
    }
}

/* The 8-lane butterfly of sl_emu_dot_q3_k over the 2 lanes (xor 1) of a row holding
 * 4 accumulators each; both lanes end with the sum. */
__device__ __forceinline__ float k_comb2(float (&a)[4])
{
#pragma unroll
    for (int s = 0; s < 4; s++) a[s] = sl_emu_add(a[s], __shfl_xor_sync(~0u, a[s], 1));
    return sl_emu_add(sl_emu_add(a[0], a[2]), sl_emu_add(a[1], a[3]));
}

/* Down (Q3_K) of every expert of the table and their sum, one CTA per tile of TD
 * output rows: thread 0 queues the tile's rows of every expert at once (one stage
 * and mbarrier per expert), LPR lanes a row compute them (LPR 8: k_dot_q3_k, LPR 2:
 * k_dot4_q3_k; a group of TD*LPR threads per expert), the bf16-rounded outputs meet
 * in shared memory and TD threads add them in table order (increasing expert id),
 * then `extra`. blockDim = n*TD*LPR rounded up to 32. TD % 8 == 0 keeps a tile a
 * multiple of 16 bytes for every inter % 256 == 0. */
template <int LPR, int TD>
__global__ void __launch_bounds__(SL_GPU_MAX_USED *TD *LPR)
    k_down_tma_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                    const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                    const float *__restrict__ extra, float *__restrict__ out_f32,
                    uint16_t *__restrict__ out_bf16)
{
    extern __shared__ int4 k_smem[];
    __shared__ float ys[SL_GPU_MAX_USED][TD];
    __shared__ uint64_t bar[SL_GPU_MAX_USED];
    const uint32_t rb = inter / 256 * 110, nb = inter / 256, sb = TD * rb;
    const int n = tab.n;
    const uint32_t r0 = blockIdx.x * TD;
    if (threadIdx.x == 0) {
        for (int e = 0; e < n; e++) k_mbar_init(bar + e, 1);
        k_mbar_fence_init();
        for (int e = 0; e < n; e++) {
            k_mbar_expect(bar + e, sb);
            k_bulk((uint8_t *)k_smem + (size_t)e * sb, tab.e[e].down + (size_t)r0 * rb, sb,
                   bar + e);
        }
    }
    k_pdl_wait();
    k_pdl_go();
    __syncthreads(); /* the barriers are initialised */
    const int grp = threadIdx.x / (TD * LPR), in = threadIdx.x % (TD * LPR);
    const int e = grp < n ? grp : n - 1; /* idle lanes shadow the last expert */
    const int r = in / LPR, sub = in % LPR;
    k_mbar_wait(bar + e, 0);
    const uint8_t *row = (const uint8_t *)k_smem + (size_t)e * sb + (size_t)r * rb;
    const int8_t *aq = hq + (size_t)e * inter;
    const float *adp = hd + (size_t)e * (inter / 32);
    float a;
    if (LPR == 8) {
        a = k_butterfly(k_dot_q3_k(row, aq, adp, nb, sub), 4);
    } else {
        float acc[4];
        k_dot4_q3_k(row, aq, adp, nb, sub, acc);
        a = k_comb2(acc);
    }
    if (grp < n && sub == 0) ys[grp][r] = sl_emu_bf16_round(a);
    __syncthreads();
    if (threadIdx.x < TD) {
        const uint32_t o = r0 + threadIdx.x;
        float y = 0.0f;
        for (int k = 0; k < n; k++) y = sl_emu_add(y, ys[k][threadIdx.x]);
        if (extra) y = sl_emu_add(y, extra[o]);
        if (out_f32) out_f32[o] = y;
        if (out_bf16) out_bf16[o] = sl_emu_bf16_bits(y);
    }
}

/* Threads and dynamic shared memory of k_down_tma_q3_k for n experts. */
inline uint32_t k_down_tma_threads(int n, int lpr, int td)
{
    return ((uint32_t)(n * td * lpr) + 31) / 32 * 32;
}
inline size_t k_down_tma_smem(int n, uint32_t inter, int td)
{
    return (size_t)n * td * (inter / 256 * 110);
}

/* Down (Q3_K) of every expert of the table and their sum: one step = 4 rows (8 lanes
 * each) of one expert; a warp walks the experts of its 4 rows in table order (which
 * the caller sorted by expert id), adds each bf16-rounded output into the rows' f32
 * sums, then `extra` (the shared expert's output, if any), and writes out_f32 and
 * bf16 out. */
template <int NW, int MAXV, bool PF>
__global__ void __launch_bounds__(NW * 32)
    k_down_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                const float *__restrict__ extra, float *__restrict__ out_f32,
                uint16_t *__restrict__ out_bf16)
{
    extern __shared__ int4 k_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, team = lane >> 3, g = lane & 7;
    int4 *st = k_smem + (size_t)warp * (MAXV * 32 + 1);
    const uint32_t rb = inter / 256 * 110, nb = inter / 256;
    const uint32_t units = dim / 4, stride = gridDim.x * NW;
    const int n = tab.n;
    uint32_t u = blockIdx.x * NW + warp;
    int e = 0;
    int4 v[MAXV];
    const int4 *p;
    int cnt = 0;
    uint32_t off = 0;
    if (PF && u < units) {
        const uint8_t *src = tab.e[0].down + (size_t)u * 4 * rb;
        cnt = k_span(src, 4 * rb, &p);
        off = (uint32_t)((uintptr_t)src & 15);
        k_span_load<MAXV>(v, p, cnt, lane);
    }
    float y = 0.0f;
    while (u < units) {
        if (!PF) {
            const uint8_t *src = tab.e[e].down + (size_t)u * 4 * rb;
            cnt = k_span(src, 4 * rb, &p);
            off = (uint32_t)((uintptr_t)src & 15);
            k_span_load<MAXV>(v, p, cnt, lane);
        }
        __syncwarp();
        k_span_store<MAXV>(v, st, cnt, lane);
        __syncwarp();
        const uint32_t coff = off;
        uint32_t un = u;
        int en = e + 1;
        if (en == n) {
            en = 0;
            un = u + stride;
        }
        if (PF && un < units) {
            const uint8_t *src = tab.e[en].down + (size_t)un * 4 * rb;
            cnt = k_span(src, 4 * rb, &p);
            off = (uint32_t)((uintptr_t)src & 15);
            k_span_load<MAXV>(v, p, cnt, lane);
        }
        float a = k_dot_q3_k((const uint8_t *)st + coff + team * rb, hq + (size_t)e * inter,
                             hd + (size_t)e * (inter / 32), nb, g);
        a = k_butterfly(a, 4);
        y = sl_emu_add(y, sl_emu_bf16_round(a));
        if (e == n - 1) {
            const uint32_t r = 4 * u + team;
            if (extra) y = sl_emu_add(y, extra[r]);
            if (g == 0) {
                if (out_f32) out_f32[r] = y;
                if (out_bf16) out_bf16[r] = sl_emu_bf16_bits(y);
            }
            y = 0.0f;
        }
        u = un;
        e = en;
    }
}

/* Dynamic shared memory of k_down_q3_k. */
inline size_t k_down_smem(int nw, int maxv)
{
    return (size_t)nw * (maxv * 32 + 1) * 16 + 16;
}

/* session 20's packed down (LPR 4, TD 8, ST 2, NG 2, early refill) held at REGS registers
 * a thread instead of __launch_bounds__'s 64: 2 CTAs of 7 experts (28 warps) still fit
 * an SM at 72, with more room for UNR blocks' chains at once (a bench variant). */
template <int REGS, int UNR>
__global__ void __maxnreg__(REGS)
    k_down_pk_regs_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                        const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                        const float *__restrict__ extra, float *__restrict__ out_f32,
                        uint16_t *__restrict__ out_bf16, float *__restrict__ part,
                        unsigned long long *stamps)
{
    k_down_pt_body<4, 8, 2, 2, false, true, false, SL_Q3K_PACKED, UNR, false>(
        tab, hq, hd, dim, inter, extra, out_f32, out_bf16, part, stamps);
}

/* The mma form (LPR 4, TD 16): 64 registers, so that 2 CTAs fit an SM. */
template <int LPR, int TD, int ST, int NG>
__global__ void __launch_bounds__(NG *SL_GPU_MAX_USED *TD *LPR, 2)
    k_down_mma_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                    const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                    const float *__restrict__ extra, float *__restrict__ out_f32,
                    uint16_t *__restrict__ out_bf16, float *__restrict__ part,
                    unsigned long long *stamps)
{
    k_down_pt_body<LPR, TD, ST, NG, true, false, false>(tab, hq, hd, dim, inter, extra, out_f32,
                                                        out_bf16, part, stamps);
}

/* The bulk-copy down kernel of a configuration (mma or dp4a). */
template <int LPR, int TD, int ST, int NG, bool MMA> struct k_down_kern {
    static constexpr auto fn = &k_down_pt_q3_k<LPR, TD, ST, NG>;
};
template <int LPR, int TD, int ST, int NG> struct k_down_kern<LPR, TD, ST, NG, true> {
    static constexpr auto fn = &k_down_mma_q3_k<LPR, TD, ST, NG>;
};

/* ---- the down in one round: a CTA a tile ----
 *
 * k_down_pt_q3_k's CTAs run two groups of n warps over two stages of whole tiles, so an
 * SM serves 4 tiles at a time (28 warps at 64 registers): at dim 5120 the 640 tiles of a
 * 7-expert token leave 112 for a second round, which runs alone for ~4 us. Here a CTA
 * is one tile of SL_DR_TD output rows: warp e computes expert e's rows (4 lanes a row,
 * k_dot2_block's arithmetic, blocks in increasing order) and streams them through a
 * ring of NB chunks of CB blocks (the 8 rows' blocks c * CB ..) in its own shared
 * memory, copied by its own lanes with cp.async: no mbarrier, no CTA barrier before the
 * sum. At CB 3, NB 2 a warp holds 5.25 KB, so 5 CTAs fit an SM (35 warps at 56
 * registers, 189 KB at n = 7) and every tile of such a token is resident at once. The
 * sum and the outputs are k_down_pt_q3_k's (k_down_store). Packed blocks in device
 * memory only (16-byte aligned rows). blockDim = 32 * n, grid = dim / SL_DR_TD.
 * Milestones (STAMP, CTA c's record c): 0 entry, 1 past the kernel before, 2 warp 0's
 * first chunk landed, 3 the tile's rows stored, 30 the end. */
#define SL_DR_TD   8
#define SL_DR_REGS 56

__host__ __device__ constexpr uint32_t k_dr_warp_bytes(int cb, int nb)
{
    return (uint32_t)nb * SL_DR_TD * cb * SL_Q3K_PACKED;
}

/* cp.async.wait_group with a count known at run time (0 .. 3) */
__device__ __forceinline__ void k_cp_wait_upto(uint32_t pending)
{
    if (pending >= 3)
        k_cp_wait<3>();
    else if (pending == 2)
        k_cp_wait<2>();
    else if (pending == 1)
        k_cp_wait<1>();
    else
        k_cp_wait<0>();
}

template <int CB, int NB, bool STAMP = false>
__global__ void __maxnreg__(SL_DR_REGS)
    k_down_ring_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                     const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                     const float *__restrict__ extra, float *__restrict__ out_f32,
                     uint16_t *__restrict__ out_bf16, float *__restrict__ part,
                     unsigned long long *stamps)
{
    static_assert(CB >= 1 && NB >= 2 && NB <= 4, "a ring of 2 to 4 chunks");
    constexpr int BB = SL_Q3K_PACKED, PIECES = BB / 16; /* 16-byte copies a block */
    constexpr uint32_t CBYTES = SL_DR_TD * CB * BB;
    extern __shared__ int4 k_smem[];
    __shared__ float ys[SL_GPU_MAX_USED][SL_DR_TD];
    const int e = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, sub = lane & 3;
    const uint32_t nb = inter / 256, rb = nb * BB, nch = (nb + CB - 1) / CB, t = blockIdx.x;
    uint8_t *const ring = (uint8_t *)k_smem + (size_t)e * NB * CBYTES;
    const uint8_t *const src = tab.e[e].down + ((size_t)t * SL_DR_TD + r) * rb; /* row r */
    /* chunk c (blocks c * CB .., cb of them) into buffer c % NB, row r at r * cb * BB:
     * lane 4r + sub copies pieces sub, sub + 4, ... of row r */
    auto issue = [&](uint32_t c) {
        const uint32_t b0 = c * CB, cb = nb - b0 < (uint32_t)CB ? nb - b0 : (uint32_t)CB;
        uint8_t *d = ring + (c % NB) * CBYTES + r * cb * BB;
        const uint8_t *s = src + (size_t)b0 * BB;
        for (uint32_t p = sub; p < cb * PIECES; p += 4) k_cp16(d + 16 * p, s + 16 * p);
        k_cp_commit();
    };
    unsigned long long *rec = STAMP ? k_stamp_rec(stamps, 1, 0, threadIdx.x == 0) : nullptr;
    k_stamp(rec, 0);
    for (uint32_t c = 0; c < (uint32_t)NB && c < nch; c++) issue(c);
    k_pdl_wait(); /* h's q8_1 is the kernel before's */
    k_stamp(rec, 1);
    const int hs = tab.e[e].slot;
    const int8_t *const aq = hq + (size_t)hs * inter;
    const float *const ad = hd + (size_t)hs * (inter / 32);
    const k_q3_sel ls = k_q3_sel_of(sub);
    float acc[2] = {0.0f, 0.0f};
    for (uint32_t c = 0; c < nch; c++) {
        const uint32_t b0 = c * CB, cb = nb - b0 < (uint32_t)CB ? nb - b0 : (uint32_t)CB;
        const uint32_t later = nch - 1 - c; /* chunks queued after c: at most NB - 1 */
        k_cp_wait_upto(later < (uint32_t)NB - 1 ? later : (uint32_t)NB - 1);
        __syncwarp(); /* every lane's pieces of the chunk are visible to the warp */
        if (c == 0) k_stamp_unit(rec, 0, 0);
        const uint8_t *row = ring + (c % NB) * CBYTES + r * cb * BB;
        const int8_t *a = aq + 256 * b0;
        const float *d = ad + 8 * b0;
#pragma unroll 1
        for (uint32_t b = 0; b < cb; b++) k_dot2_block<BB>(row, a, d, b, ls, acc);
        __syncwarp(); /* every lane is done with the buffer */
        if (c + NB < nch) issue(c + NB);
    }
    const float v = k_comb22(acc);
    if (sub == 0) ys[e][r] = sl_emu_bf16_round(v);
    __syncthreads();
    if (threadIdx.x < SL_DR_TD)
        k_down_store(tab, t * SL_DR_TD + threadIdx.x, dim, &ys[0][threadIdx.x], SL_DR_TD, extra,
                     out_f32, out_bf16, part);
    k_stamp_unit(rec, 0, 1);
    k_stamp_end(rec, 1);
}

/* ---- the fused layer: gate/up, q8_1 of h and down in one persistent launch ----
 *
 * The launches of a layer each pay a start, a pipeline fill and a tail (bench-moe's
 * fit: about 8 us the gate/up, 4 us the down). One launch takes both: CTA c runs the
 * units u = c, c + grid, ... of one list, first every gate/up unit (k_gateup_tma_body's,
 * the shared expert first when sh_first), then every down unit (TD output rows of one
 * expert, in the same expert order). A down unit's weights are queued as soon as its
 * stage is free, so they stream in during the gate/up's tail; only its arithmetic
 * waits, for its expert's h. The waits cannot deadlock: a CTA finishes all its gate/up
 * units before its first down unit, and the grid is no larger than what fits at once.
 *
 * h's q8_1 groups: the unit that completes a group (32 / TR units; counted in s.cnt)
 * quantizes it (k_q8_lane: k_quant_h's bits) and counts it in
 * sync[slot]; a down unit waits for inter / 32 there, then copies its expert's codes and
 * scales into shared memory (through L2: L1 is not coherent with other SMs' writes).
 * Fences: the writers' group meets at its barrier, then one thread fences and counts
 * (cumulative, as a grid barrier's arrival). Each down unit writes its
 * bf16-rounded rows apart (part, by slot, as k_down_pt_q3_k's part form) and counts
 * itself in its tile's counter; when the table holds every expert of the token (n_all),
 * the tile's last unit adds the slots in order, then extra: k_combine's sum, bit for
 * bit. Otherwise the rest of the token's experts follow and k_combine sums. */
/* One warp after the rows r0.. of slot's h are written (warp 0 of the group that wrote
 * them, after the group's barrier; HELP: the group's helper, after its __syncwarp):
 * counts the unit in its q8_1 group (lane 0's fence, after the barrier, makes
 * the whole group's writes visible first); the unit completing the group quantizes it
 * and counts the group in ready[slot]. */
__device__ __forceinline__ void k_fused_h_done(const sl_kscratch &s, unsigned *ready, int slot,
                                               uint32_t r0, uint32_t inter, unsigned per, int lane)
{
    const uint32_t g = (uint32_t)slot * (inter / 32) + r0 / 32;
    unsigned old = 0;
    if (lane == 0) {
        __threadfence();
        old = atomicAdd(&s.cnt[g], 1u);
        __threadfence(); /* acquire: the other units' rows, before the warp reads them */
    }
    old = __shfl_sync(~0u, old, 0);
    if (old != per - 1) return;
    __syncwarp();
    k_quant_h_group(s, g, __ldcg(&s.h[(size_t)g * 32 + lane]), lane);
    if (lane == 0) s.cnt[g] = 0;
    __syncwarp();
    if (lane == 0) {
        __threadfence();
        atomicAdd(&ready[slot], 1u);
    }
}

/* One warp, after a down unit's rows of tile t are in part (by its group's barrier or
 * its own __syncwarp): counts the unit in the tile; the tile's last expert adds every
 * slot's rows in order (slots 0..n-1: a full table's slots are exactly those, the
 * routed experts by id, then the shared one), then extra, when the table holds the
 * whole token (k_combine's sum), and zeroes the count. */
template <int TD>
__device__ __forceinline__ void k_fused_tile_done(const sl_kfuse &f, unsigned *tiles, uint32_t t,
                                                  int n, uint32_t dim, int lane)
{
    unsigned old = 0;
    if (lane == 0) {
        __threadfence(); /* after the barrier: the group's rows are visible first */
        old = atomicAdd(&tiles[t], 1u);
        __threadfence(); /* acquire: the other experts' rows, before the warp reads them */
    }
    old = __shfl_sync(~0u, old, 0);
    if (old != (unsigned)n - 1) return;
    __syncwarp();
    if (n == f.n_all && lane < TD) {
        const uint32_t o = t * TD + lane;
        float v = 0.0f;
        for (int e = 0; e < n; e++) v = sl_emu_add(v, __ldcg(&f.part[(size_t)e * dim + o]));
        if (f.extra) v = sl_emu_add(v, f.extra[o]);
        if (f.out_f32) f.out_f32[o] = v;
        if (f.out_bf16) f.out_bf16[o] = sl_emu_bf16_bits(v);
    }
    if (lane == 0) tiles[t] = 0;
}

/* The list of each CTA: fused_plan.h's with aff = AFF (1: one expert's downs a CTA, so
 * that each group copies that activation once; else round-robin, a copy into the stage
 * each; 2, 3: round-robin interleaved by expert, the downs one or two experts behind).
 * HELP: each group has a helper warp besides (blockDim NG * (NW + 1) * 32) that takes
 * the unit's outputs from shared memory (two buffers a group, mbarriers full/empty) and
 * publishes them: h with its q8_1 group count, or the down rows with the tile count and
 * sum; so no fence, atomic or global write sits on the compute warps' path. */
template <int NW, int TR, int ST, int NG, int TD, int AFF, bool HELP, bool DEV>
__device__ __forceinline__ void
k_moe_fused_body(const sl_ktab &tab, sl_ktab *tab_dst, const sl_ktab *__restrict__ tabp,
                 const sl_kexp &sh, int sh_first, const uint8_t *__restrict__ ximg, uint32_t dim,
                 uint32_t inter, float limit, const sl_kscratch &s, const sl_kfuse &f)
{
    static_assert(ST % NG == 0, "stages are split evenly between the groups");
    static_assert(TD * 8 == NW * 32, "a down unit: TD rows of 8 lanes, one group, one warp a sum");
    static_assert(TD <= 32, "one warp sums a tile");
    static_assert(32 % TR == 0, "whole units make a q8_1 group");
    static_assert(!HELP || NG > 1, "a helper must not be in the units' CTA-wide barrier");
    extern __shared__ int4 k_smem[];
    __shared__ unsigned seen; /* slots whose h this CTA saw complete */
    /* HELP: each group's two output buffers and their barriers */
    __shared__ float hbuf[HELP ? NG : 1][2][32];
    __shared__ uint64_t hfull[HELP ? NG : 1][2], hempty[HELP ? NG : 1][2];
    static_assert(AFF >= 0 && AFF <= 3, "fused_plan.h's aff: 0 to 3");
    constexpr bool ONE = AFF == 1; /* one expert's downs a CTA */
    __shared__ int act_ready;      /* ONE: gact holds the CTA's expert's activation */
    int8_t *aq = (int8_t *)k_smem;
    float *ad = (float *)(aq + dim + dim / 8);
    int *as = (int *)(ad + dim / 32);
    uint8_t *stage = (uint8_t *)k_smem + k_gu4_xbytes(dim);
    const uint32_t rb = dim / 256 * 84, nb = dim / 256, sb = k_gut_stage(dim, TR);
    const uint32_t db = inter / 256 * 110, gpe = inter / 32;
    uint64_t *bar = (uint64_t *)(stage + (size_t)ST * sb);
    uint64_t *xbar = bar + ST;
    /* ONE: the CTA's copy of its expert's activation (codes, then scales) */
    int8_t *gact = (int8_t *)(((uintptr_t)(xbar + 1) + 15) & ~(uintptr_t)15);
    const uint32_t tpe = inter / TR, grid = gridDim.x;
    const int lane = threadIdx.x & 31, grp = threadIdx.x / (NW * 32),
              warp = (threadIdx.x >> 5) % NW, in = threadIdx.x % (NW * 32);
    unsigned *ready = f.sync, *done = f.sync + SL_GPU_MAX_USED, *tiles = f.sync + SL_KFUSE_TILES;
    uint32_t rot = 0; /* entry j of the list is table entry (j + rot) % n */
    sl_fused_plan plan;

    auto entry = [&](uint32_t j) -> const sl_kexp & { return tab.e[(j + rot) % tab.n]; };
    auto unit_of = [&](uint32_t k, uint32_t &j, uint32_t &x) {
        return sl_fused_plan_unit(&plan, k, &j, &x);
    };
    auto issue_rows = [&](uint32_t k, const sl_kexp &e, uint32_t r0) {
        k_issue_gu_rows<TR>(stage + (size_t)(k % ST) * sb, bar + k % ST, e, r0, rb, TR * rb);
    };
    auto issue = [&](uint32_t k) { /* the CTA's k-th unit into stage k % ST */
                                   uint32_t j, x;
                                   const int kind = unit_of(k, j, x);
                                   if (kind == SL_FP_GATEUP) issue_rows(k, entry(j), x);
                                   if (kind != SL_FP_DOWN) return;
                                   uint64_t *b = bar + k % ST;
                                   k_mbar_expect(b, TD * db);
                                   k_bulk(stage + (size_t)(k % ST) * sb,
                                          entry(j).down + (size_t)x * TD * db, TD * db, b);
    };
    if (!DEV) sl_fused_plan_init(&plan, (uint32_t)tab.n, tpe, dim / TD, TR, grid, blockIdx.x, AFF);
    if (HELP && threadIdx.x == 0)
        for (int g = 0; g < NG; g++)
            for (int b = 0; b < 2; b++) {
                k_mbar_init(&hfull[g][b], 1);
                k_mbar_init(&hempty[g][b], 1);
            }
    const uint32_t early = k_gu_pipe_start<ST, TR, DEV>(
        bar, ST + 1 /* and xbar */, sh_first, tpe, issue,
        [&](uint32_t k, uint32_t r0) { issue_rows(k, sh, r0); }, [] {}, k_unit_rr());
    if (DEV) {
        if (threadIdx.x == 0) *tab_dst = *tabp; /* tab is *tab_dst */
        __syncthreads();
        sl_fused_plan_init(&plan, (uint32_t)tab.n, tpe, dim / TD, TR, grid, blockIdx.x, AFF);
        if (ONE && grid < (uint32_t)tab.n) __trap(); /* an entry would have no CTA */
        rot = sh_first ? (uint32_t)tab.n - 1 : 0;
        if (threadIdx.x == 0)
            for (uint32_t k = 0; k < ST; k++)
                if (!(early >> k & 1)) issue(k);
    }
    if (threadIdx.x == 0) {
        seen = 0;
        act_ready = 0;
        k_ximg_load(aq, ximg, dim, xbar);
    }
    __syncthreads();
    k_mbar_wait(xbar, 0);
    unsigned long long *stamp = f.stamps ? f.stamps + 4 * (size_t)blockIdx.x : NULL;
    if (stamp && threadIdx.x == 0) stamp[0] = k_globaltimer(), stamp[1] = stamp[2] = 0;

    if (HELP && threadIdx.x >= NG * NW * 32) { /* group hg's helper: publishes its units */
        const int hg = (threadIdx.x - NG * NW * 32) >> 5;
        for (uint32_t k = hg;; k += NG) {
            uint32_t j, x;
            const int kind = unit_of(k, j, x);
            if (kind == SL_FP_NONE) break;
            const uint32_t i = k / NG, b = i & 1;
            k_mbar_wait(&hfull[hg][b], (i >> 1) & 1);
            const int rows = kind == SL_FP_GATEUP ? TR : TD;
            const float v = lane < rows ? hbuf[hg][b][lane] : 0.0f;
            __syncwarp();
            if (lane == 0) k_mbar_arrive(&hempty[hg][b]);
            const int slot = entry(j).slot;
            if (kind == SL_FP_GATEUP) {
                if (lane < TR) s.h[(size_t)slot * inter + x + lane] = v;
                __syncwarp();
                k_fused_h_done(s, ready, slot, x, inter, 32 / TR, lane);
            } else {
                if (lane < TD) f.part[(size_t)slot * dim + x * TD + lane] = v;
                __syncwarp();
                k_fused_tile_done<TD>(f, tiles, x, tab.n, dim, lane);
            }
        }
    }
    int have = -1; /* ONE: the slot whose activation gact holds, as this group knows */
    for (uint32_t k = grp; !(HELP && threadIdx.x >= NG * NW * 32); k += NG) {
        uint32_t j, x;
        const int kind = unit_of(k, j, x);
        if (kind == SL_FP_NONE) break;
        k_mbar_wait(bar + k % ST, (k / ST) & 1);
        const uint8_t *st = stage + (size_t)(k % ST) * sb;
        auto stage_free = [&] {
            k_fence_proxy();
            issue(k + ST);
        };
        const sl_kexp &ex = entry(j);
        const uint32_t hb = (k / NG) & 1, hpar = ((k / NG / 2) & 1) ^ 1; /* HELP: buffer */
        if (kind == SL_FP_GATEUP) {
            if (HELP) k_mbar_wait(&hempty[grp][hb], hpar);
            k_gateup_dp4a_unit<NW, TR, NG>(st, TR * rb, rb, nb, aq, ad, as, grp, warp, lane, ex,
                                           HELP ? hbuf[grp][hb] : s.h + (size_t)ex.slot * inter + x,
                                           limit, stage_free);
            if (HELP) {
                if (in == 0) k_mbar_arrive(&hfull[grp][hb]); /* after the unit's barrier */
            } else if (warp == 0) {
                k_fused_h_done(s, ready, ex.slot, x, inter, 32 / TR, lane);
            }
            continue;
        }
        const int slot = ex.slot;
        const uint32_t t = x;
        int8_t *hq = ONE ? gact : (int8_t *)st + TD * db;
        float *hd = (float *)(hq + inter);
        /* ONE: the CTA's one copy, made by the group of its first down unit (k == kg);
         * the other groups wait for that group's flag */
        const bool filler = !ONE || k == plan.kg;
        if (stamp && threadIdx.x == 0 && !stamp[1]) stamp[1] = k_globaltimer();
        if (ONE && !filler && have != slot) {
            if (in == 0)
                for (uint32_t spin = 0; !*(volatile int *)&act_ready; spin++) {
                    if (spin > (1u << 24)) __trap(); /* seconds */
                    __nanosleep(32);
                }
            k_group_bar<NW>(grp);
            have = slot;
        }
        if (filler && (!ONE || have != slot)) { /* wait for the expert's h, copy its q8_1 */
            if (in == 0 && !(*(volatile unsigned *)&seen >> slot & 1)) {
                /* bounded: a broken count traps (a launch error) instead of hanging */
                for (uint32_t spin = 0; k_ld_acquire(&ready[slot]) < gpe; spin++) {
                    if (spin > (1u << 22)) __trap(); /* seconds */
                    __nanosleep(64);
                }
                atomicOr(&seen, 1u << slot);
            }
            k_group_bar<NW>(grp);
            for (uint32_t i = in; i < inter / 16; i += NW * 32)
                ((int4 *)hq)[i] = __ldcg((const int4 *)(s.hq + (size_t)slot * inter) + i);
            for (uint32_t i = in; i < gpe / 4; i += NW * 32)
                ((int4 *)hd)[i] = __ldcg((const int4 *)(s.hd + (size_t)slot * gpe) + i);
            k_group_bar<NW>(grp);
            if (ONE && in == 0) {
                __threadfence_block();
                *(volatile int *)&act_ready = 1;
            }
            have = slot;
        }
        if (stamp && threadIdx.x == 0 && !stamp[2]) stamp[2] = k_globaltimer();
        const int r = in >> 3, sub = in & 7;
        const float a = k_butterfly(k_dot_q3_k<true>(st + r * db, hq, hd, inter / 256, sub), 4);
        if (HELP) {
            k_mbar_wait(&hempty[grp][hb], hpar);
            if (sub == 0) hbuf[grp][hb][r] = sl_emu_bf16_round(a);
            k_group_bar<NW>(grp);
            if (in == 0) {
                stage_free();
                k_mbar_arrive(&hfull[grp][hb]);
            }
            continue;
        }
        if (sub == 0) f.part[(size_t)slot * dim + t * TD + r] = sl_emu_bf16_round(a);
        k_group_bar<NW>(grp);
        if (warp) continue;
        if (lane == 0) stage_free();
        k_fused_tile_done<TD>(f, tiles, t, tab.n, dim, lane);
    }
    __syncthreads(); /* the last CTA out leaves sync zero for the next launch */
    if (threadIdx.x == 0) {
        if (stamp) stamp[3] = k_globaltimer();
        __threadfence();
        if (atomicAdd(done, 1u) == grid - 1) {
            for (int i = 0; i < SL_GPU_MAX_USED; i++) ready[i] = 0;
            *done = 0;
        }
    }
}

/* Dynamic shared memory of the fused kernel (aff 1: the CTA's activation besides). */
inline size_t k_moe_fused_smem(uint32_t dim, uint32_t inter, int tr, int st, int aff)
{
    return k_gateup_tma_smem(dim, tr, st) + (aff == 1 ? (size_t)inter + inter / 32 * 4 : 0);
}

/* Whether a down unit (TD rows, and its activation after them unless aff is 1) fits
 * the stage of a gate/up unit of TR rows: the launcher's check. */
inline bool k_moe_fused_fits(uint32_t dim, uint32_t inter, int tr, int td, int aff)
{
    return (size_t)td * (inter / 256 * 110) + (aff == 1 ? 0 : inter + inter / 8) <=
           k_gut_stage(dim, tr);
}

/* A bench variant (bench/gpu/moe): its downs are raw GGUF blocks (110 bytes), not the
 * packed ones compute/ keeps in device memory (gpu.h). */
template <int NW, int TR, int ST, int NG, int TD, int AFF, bool HELP>
__global__ void __launch_bounds__(NG *(NW + HELP) * 32, 1)
    k_moe_fused_q2q3(const __grid_constant__ sl_ktab tab, const uint8_t *__restrict__ ximg,
                     uint32_t dim, uint32_t inter, float limit,
                     const __grid_constant__ sl_kscratch s, const __grid_constant__ sl_kfuse f)
{
    k_moe_fused_body<NW, TR, ST, NG, TD, AFF, HELP, false>(tab, NULL, NULL, tab.e[0], 0, ximg, dim,
                                                           inter, limit, s, f);
}

/* The same with the table in device memory (k_route_select's, as k_gateup_tma_dev_q2_k). */
template <int NW, int TR, int ST, int NG, int TD, int AFF, bool HELP>
__global__ void __launch_bounds__(NG *(NW + HELP) * 32, 1)
    k_moe_fused_dev_q2q3(const sl_ktab *__restrict__ tabp, const uint8_t *__restrict__ ximg,
                         uint32_t dim, uint32_t inter, float limit,
                         const __grid_constant__ sl_kscratch s, const __grid_constant__ sl_kfuse f,
                         const __grid_constant__ sl_kexp sh, int sh_first)
{
    __shared__ sl_ktab tab;
    k_moe_fused_body<NW, TR, ST, NG, TD, AFF, HELP, true>(tab, &tab, tabp, sh, sh_first, ximg, dim,
                                                          inter, limit, s, f);
}

} /* namespace */

#endif
