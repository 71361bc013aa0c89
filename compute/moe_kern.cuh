/* moe_kern.cuh - the MoE kernels (device code and launch templates).
 *
 * Included by compute/moe.cu (which instantiates the configuration that won in
 * bench/gpu/moe) and by the bench's sandbox (bench/gpu/moe_sandbox.cuh: the kernels
 * that lost, built on the helpers and bodies here); nothing here has external linkage.
 * The lane mappings and f32 steps are mirrored exactly by compute/moe_emu.c: change
 * both together. The shape rules the launchers rely on (dim, inter multiples of 256,
 * 16-byte aligned tensors, n <= SL_GPU_MAX_USED) are checked by the C entries.
 *
 * Weights are streamed once, into shared memory, two ways: the register-staged
 * kernels (each warp copies its rows with 16-byte evict-first loads into a per-warp
 * stage) serve mapped (zero-copy) host memory best; the bulk-copy kernels (*_tma_*:
 * one thread queues whole row tiles with cp.async.bulk into mbarrier stages) serve
 * device memory best. Both read either kind correctly and compute the same bits.
 */
#ifndef SL_MOE_KERN_CUH
#define SL_MOE_KERN_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <utility>

#include "gpu.h"
#include "k_launch.cuh"
#include "moe_emu.h"
#include "score.h"

#ifndef SL_GPU_MAX_USED
#define SL_GPU_MAX_USED 8
#endif

/* One expert as the kernels see it (device-visible pointers) and the table of one
 * launch, passed by value (it lives in the kernel's constant bank). */
struct sl_kexp {
    const uint8_t *gate, *up, *down;
    float w;  /* routing weight (1 for the shared expert) */
    int slot; /* row block of this expert's h in the scratch (its rank in expert id order) */
};
struct sl_ktab {
    int n;
    unsigned pk; /* bit i: e[i].down is tiled in device memory (SL_Q3K_TB), else raw */
    sl_kexp e[SL_GPU_MAX_USED];
};
/* The gate/up's part of an entry and a table of them: the device-table gate/up keeps its
 * table in shared memory, where its bytes count (k_gateup_tma_dev_q2_k). */
struct sl_kgu {
    const uint8_t *gate, *up;
    float w;
    int slot;
};
struct sl_kgutab {
    int n;
    sl_kgu e[SL_GPU_MAX_USED];
};

/* Scratch of one gate/up -> down pass. */
struct sl_kscratch {
    float *h;                   /* [n][inter] SwiGLU outputs */
    int8_t *hq;                 /* [n][inter] their q8_1 codes */
    float *hd;                  /* [n][inter/32] their q8_1 scales */
    unsigned *cnt;              /* [n][inter/32] rows done per q8_1 group (0 between launches) */
    unsigned long long *stamps; /* NULL, or the gate/up's milestones (k_stamp; bench) */
};

#define SL_KSTAMP_SLOTS 32
#define SL_KSTAMP_UNITS 11

namespace
{

__device__ __forceinline__ unsigned long long k_globaltimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned k_ld_acquire(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void k_st_release(unsigned *p, unsigned v)
{
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long k_ld_relaxed64(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void k_st_relaxed64(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

/* The device tier's gate/up table as the selection publishes it to the device-table
 * gate/up: 64-bit words, each carrying the selection's tag in its low 4 bits (1..15 in
 * turn, one a selection, kept by the context apart from the routing's number; the zeros
 * the table starts from never match), so that every word proves itself current and
 * one round of loads reads a complete table, with no flag and no fence between the
 * table and a flag. w[0]: n << 4; entry i: w[1 + 3i] gate, w[2 + 3i] up (16-byte
 * aligned: the bulk copies need it), w[3 + 3i] the routing weight's bits << 32 | slot
 * << 4. Every selection writes every word (the entries past n with a zero payload), so
 * a word not yet rewritten carries the last selection's tag, never this one's. Each
 * word is single-copy atomic (aligned, relaxed at gpu scope). */
#define SL_KTT_WORDS (1 + 3 * SL_GPU_MAX_USED)
struct sl_kttab {
    unsigned long long w[SL_KTT_WORDS];
};

/* Bench instrumentation of the weight-streaming kernels (NULL in compute/): a group
 * leader's %globaltimer at its milestones, SL_KSTAMP_SLOTS slots a (CTA, group) record:
 * 0 entry, 1 past the previous kernel (and, gate/up, x landed), 2 + 2i unit i's bytes
 * landed and 3 + 2i unit i done (i < SL_KSTAMP_UNITS); in the bulk-copy gate/up, 24 the
 * ns its leader spent queueing refills after its units (a sum, not a time) and 25 their
 * count; in the device-table gate/up's group 0, 26 x's image landed (seen by its second
 * warp, which waits for nothing else), 27 the routed stages queued after the table
 * (thread 0) and 28 the selection's table read; 29 (the device-table gate/up) past its
 * final wait for the selection's grid, 30 the group's end, 31 its units (low 32 bits)
 * and its SM. */
__device__ __forceinline__ uint32_t k_smid()
{
    uint32_t id;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
    return id;
}

__device__ __forceinline__ void k_stamp(unsigned long long *rec, uint32_t slot)
{
    if (rec) rec[slot] = k_globaltimer();
}

/* The record of this CTA's group grp of ng, or NULL. */
__device__ __forceinline__ unsigned long long *k_stamp_rec(unsigned long long *stamps, int ng,
                                                           int grp, bool lead)
{
    return stamps && lead ? stamps + ((size_t)blockIdx.x * ng + grp) * SL_KSTAMP_SLOTS : NULL;
}

/* The time since t0 (a %globaltimer read) added to the record's queueing sum (slot 24),
 * and one more to its count (slot 25). */
__device__ __forceinline__ void k_stamp_add(unsigned long long *rec, unsigned long long t0)
{
    rec[24] += k_globaltimer() - t0;
    rec[25] += 1;
}

/* Unit i's two stamps (landed, done) and the record's end. */
__device__ __forceinline__ void k_stamp_unit(unsigned long long *rec, uint32_t i, int done)
{
    if (i < SL_KSTAMP_UNITS) k_stamp(rec, 2 + 2 * i + done);
}

__device__ __forceinline__ void k_stamp_end(unsigned long long *rec, uint32_t units)
{
    k_stamp(rec, 30);
    if (rec) rec[31] = units | (unsigned long long)k_smid() << 32;
}

__device__ __forceinline__ float k_half(const uint8_t *p)
{
    return __half2float(__ushort_as_half(*(const unsigned short *)p));
}

/* An activation load: through L1 (read-only for the kernel), or from shared memory. */
template <bool SH, typename T> __device__ __forceinline__ T k_ld_act(const T *p)
{
    if constexpr (SH)
        return *p;
    else
        return __ldg(p);
}

/* 16-byte streaming load (weights are read once per token). */
__device__ __forceinline__ int4 k_ld_stream(const int4 *p)
{
    return __ldcs(p);
}

/* The 16-byte chunks covering [p, p+bytes): count and the aligned start. */
__device__ __forceinline__ int k_span(const uint8_t *p, uint32_t bytes, const int4 **start)
{
    const uintptr_t s = (uintptr_t)p & ~(uintptr_t)15;
    const uintptr_t e = ((uintptr_t)p + bytes + 15) & ~(uintptr_t)15;
    *start = (const int4 *)s;
    return (int)((e - s) >> 4);
}

template <int MAXV>
__device__ __forceinline__ void k_span_load(int4 (&v)[MAXV], const int4 *src, int cnt, int lane)
{
#pragma unroll
    for (int k = 0; k < MAXV; k++)
        if (k * 32 + lane < cnt) v[k] = k_ld_stream(src + k * 32 + lane);
}

template <int MAXV>
__device__ __forceinline__ void k_span_store(const int4 (&v)[MAXV], int4 *dst, int cnt, int lane)
{
#pragma unroll
    for (int k = 0; k < MAXV; k++)
        if (k * 32 + lane < cnt) dst[k * 32 + lane] = v[k];
}

/* Eight consecutive 32-bit words at a 2-byte aligned shared address. The aligned
 * pointer is p moved back, not p's integer masked: a pointer rebuilt from an integer
 * loses its address space, and the loads become generic ones (ld instead of ld.shared,
 * waited on like global loads: bench/results/2026-12-01-s8-stalls.md). */
__device__ __forceinline__ void k_ld8(const uint8_t *p, uint32_t (&w)[8])
{
    const uintptr_t a = (uintptr_t)p;
    const uint32_t *q = (const uint32_t *)(p - (a & 3));
    const uint32_t sh = (uint32_t)(a & 3) * 8;
    uint32_t t[9];
#pragma unroll
    for (int i = 0; i < 9; i++) t[i] = q[i];
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = __funnelshift_r(t[i], t[i + 1], sh);
}

/* Tiles Q3_K down rows into the tiled layout (SL_Q3K_TB, moe_emu.h): src holds tiles *
 * 8 raw rows of nb blocks (110 bytes each, 2-byte aligned), dst gets tiles * nb tiled
 * blocks (16-byte aligned); a thread a word of dst, its bytes gathered by
 * sl_emu_q3_k_tb_byte (sl_emu_pack_q3_k_tb's function). */
__global__ void k_pack_q3_k_tb(const uint8_t *__restrict__ src, uint32_t tiles, uint32_t nb,
                               uint8_t *__restrict__ dst)
{
    constexpr uint32_t wpb = SL_Q3K_TB / 4;
    const uint64_t w = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= (uint64_t)tiles * nb * wpb) return;
    const uint64_t tb = w / wpb; /* the tiled block: tile tb / nb, block tb % nb */
    const uint32_t o = (uint32_t)(w % wpb) * 4;
    const uint64_t stride = (uint64_t)nb * 110; /* a raw row */
    const uint8_t *blk0 = src + tb / nb * 8 * stride + tb % nb * 110;
    uint32_t word = 0;
    for (uint32_t t = 0; t < 4; t++)
        word |= (uint32_t)sl_emu_q3_k_tb_byte(blk0, stride, o + t) << (8 * t);
    ((uint32_t *)dst)[w] = word;
}

/* Three words (the Q3_K scales) at a 2-byte aligned shared address; reads at most 2
 * bytes past them. */
__device__ __forceinline__ void k_ld3(const uint8_t *p, uint32_t (&w)[3])
{
    const uintptr_t a = (uintptr_t)p;
    const uint32_t *q = (const uint32_t *)(p - (a & 3)); /* as k_ld8 */
    const uint32_t sh = (uint32_t)(a & 3) * 8;
    const uint32_t t0 = q[0], t1 = q[1], t2 = q[2], t3 = sh ? q[3] : 0u;
    w[0] = __funnelshift_r(t0, t1, sh);
    w[1] = __funnelshift_r(t1, t2, sh);
    w[2] = __funnelshift_r(t2, t3, sh);
}

/* Eight words from two 16-byte aligned vectors. */
__device__ __forceinline__ void k_ld16x2(const uint4 *v, uint32_t (&w)[8])
{
    const uint4 a = v[0], b = v[1];
    w[0] = a.x;
    w[1] = a.y;
    w[2] = a.z;
    w[3] = a.w;
    w[4] = b.x;
    w[5] = b.y;
    w[6] = b.z;
    w[7] = b.w;
}

/* Quantizes one block of 32 activations held one per lane (the sl_block_q8_1 rules);
 * returns the lane's code and puts the block's scale in *d. */
__device__ __forceinline__ int k_q8_lane(float v, float *d)
{
    float amax = fabsf(v);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, off));
    *d = sl_emu_div(amax, 127.0f);
    return sl_emu_q8_code(v, *d, amax);
}

/* q8_1 group g of h (value v of each lane) into s.hq and s.hd: k_quant_h's bits, the
 * one store of h's q8_1 that every kernel writing it shares. */
__device__ __forceinline__ void k_quant_h_group(const sl_kscratch &s, uint32_t g, float v, int lane)
{
    float d;
    const int q = k_q8_lane(v, &d);
    s.hq[(size_t)g * 32 + lane] = (int8_t)q;
    if (lane == 0) s.hd[g] = d;
}

/* Block b of the activation (value v of each lane) into codes aq, scale ad[b] and the
 * two sums of 16 codes as; PAD: k_quant_x's padded layout. */
template <bool PAD>
__device__ __forceinline__ void k_quant_block(float v, uint32_t b, int lane, int8_t *aq, float *ad,
                                              int *as)
{
    float d;
    const int q = k_q8_lane(v, &d);
    aq[32 * b + lane + (PAD ? 16 * (b / 4) : 0)] = (int8_t)q;
    int sum = q;
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) sum += __shfl_xor_sync(~0u, sum, off);
    if ((lane & 15) == 0) as[2 * b + (lane >> 4) + (PAD ? 4 * (b / 16) : 0)] = sum;
    if (lane == 0) ad[b] = d;
}

/* The activation x (bf16) quantized into shared memory by the whole CTA: codes aq[n],
 * scales ad[n/32], sums of 16 codes as[n/16]. PAD (the x image's layout): 16
 * bytes after every 128 codes and 4 ints after every 32 sums, so that the 8 lanes of
 * a row, which read 8 different blocks/halves, hit 8 different bank quads. */
template <int NW, bool PAD = false>
__device__ __forceinline__ void k_quant_x(const uint16_t *__restrict__ x, uint32_t n, int8_t *aq,
                                          float *ad, int *as)
{
    /* 8 blocks per round, loads first: the rounds are latency-bound, not the math */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t nblk = n / 32;
    for (uint32_t b0 = warp; b0 < nblk; b0 += 8 * NW) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t b = b0 + k * NW;
            v[k] = b < nblk ? sl_emu_bf16_to_f32(x[32 * b + lane]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t b = b0 + k * NW;
            if (b >= nblk) break; /* uniform across the warp */
            k_quant_block<PAD>(v[k], b, lane, aq, ad, as);
        }
    }
}

/* One lane's share of a Q2_K row (32 lanes per row; see sl_emu_dot_q2_k). row is
 * 4-byte aligned in shared memory. */
__device__ __forceinline__ float k_dot_q2_k(const uint8_t *row, const int8_t *aq, const float *ad,
                                            const int *as, uint32_t nb, int lane)
{
    const int g = lane & 7, sh = 2 * (g & 3);
    float acc = 0.0f;
    for (uint32_t b = lane >> 3; b < nb; b += 4) {
        const uint8_t *blk = row + 84 * b;
        const uint32_t *qw = (const uint32_t *)(blk + 16 + 32 * (g >> 2));
        const int4 *aw = (const int4 *)(aq + 256 * b + 32 * g);
        const int4 a0 = aw[0], a1 = aw[1];
        int c0 = 0, c1 = 0;
        c0 = __dp4a((int)((qw[0] >> sh) & 0x03030303u), a0.x, c0);
        c0 = __dp4a((int)((qw[1] >> sh) & 0x03030303u), a0.y, c0);
        c0 = __dp4a((int)((qw[2] >> sh) & 0x03030303u), a0.z, c0);
        c0 = __dp4a((int)((qw[3] >> sh) & 0x03030303u), a0.w, c0);
        c1 = __dp4a((int)((qw[4] >> sh) & 0x03030303u), a1.x, c1);
        c1 = __dp4a((int)((qw[5] >> sh) & 0x03030303u), a1.y, c1);
        c1 = __dp4a((int)((qw[6] >> sh) & 0x03030303u), a1.z, c1);
        c1 = __dp4a((int)((qw[7] >> sh) & 0x03030303u), a1.w, c1);
        const uint32_t sc = *(const unsigned short *)(blk + 2 * g);
        const int2 s16 = *(const int2 *)(as + 16 * b + 2 * g);
        const int isum = (int)(sc & 15) * c0 + (int)((sc >> 8) & 15) * c1;
        const int imin = (int)((sc >> 4) & 15) * s16.x + (int)(sc >> 12) * s16.y;
        acc = sl_emu_q2_k_step(acc, k_half(blk + 80), k_half(blk + 82), isum, imin, ad[8 * b + g]);
    }
    return acc;
}

/* dp4a of unsigned weight bytes against signed activation codes. The kernels feed it a
 * row's 2-bit (or 1-bit) fields masked in place, without shifting them down: each byte
 * is then the field times 2^sh (at most 192), and the sum over 16 values is 2^sh times
 * the fields' sum, exact in int (below 2^19), so one arithmetic shift after the half
 * group gives the same integer as shifting every word first, an instruction a word
 * cheaper (bench/results/2026-12-01-s6-moe.md). */
__device__ __forceinline__ int k_dp4a_us(uint32_t a, int b, int c)
{
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* Group g of one Q3_K block against its 32 q8_1 codes aq_g: sum of (s - 32) * code * q
 * over the group's two 16-value halves, exact in int. hm: the block's hmask words; qw:
 * the qs words of g's 128-value half, g's codes at shift sh; lo8, hi4: the 12 packed
 * scale bytes (0..7, 8..11). Codes are low - 4 * (1 - hbit): the low fields and the
 * clear high bits are summed apart (k_dp4a_us). */
template <bool SH = false>
__device__ __forceinline__ int k_q3_group(const uint32_t (&hm)[8], const uint32_t (&qw)[8], int g,
                                          int sh, uint64_t lo8, uint32_t hi4,
                                          const int8_t *__restrict__ aq_g)
{
    const int4 *aw = (const int4 *)aq_g;
    const int4 a0 = k_ld_act<SH>(aw), a1 = k_ld_act<SH>(aw + 1);
    const int av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    /* the fields in place (k_dp4a_us): sum(low * a) - 4 * sum(!hbit * a) a half */
    const uint32_t mq = 0x03030303u << sh, mh = 0x01010101u << g;
    int lo[2] = {0, 0}, nh[2] = {0, 0};
#pragma unroll
    for (int w = 0; w < 8; w++) {
        lo[w >> 2] = k_dp4a_us(qw[w] & mq, av[w], lo[w >> 2]);
        nh[w >> 2] = k_dp4a_us(~hm[w] & mh, av[w], nh[w >> 2]);
    }
    const int c0 = (lo[0] >> sh) - 4 * (nh[0] >> g), c1 = (lo[1] >> sh) - 4 * (nh[1] >> g);
    const int k0 = 2 * g, k1 = 2 * g + 1;
    const int s0 = (int)(((lo8 >> (8 * (k0 & 7) + 4 * (k0 >> 3))) & 15) |
                         ((hi4 >> (8 * (k0 & 3) + 2 * (k0 >> 2))) & 3) << 4) -
                   32;
    const int s1 = (int)(((lo8 >> (8 * (k1 & 7) + 4 * (k1 >> 3))) & 15) |
                         ((hi4 >> (8 * (k1 & 3) + 2 * (k1 >> 2))) & 3) << 4) -
                   32;
    return s0 * c0 + s1 * c1;
}

/* One lane's share of a Q3_K row (8 lanes per row, lane g = group g of every block;
 * see sl_emu_dot_q3_k). row is 2-byte aligned in shared memory; the activation
 * (codes aq, scales ad) is read through L1, or with SH from shared memory. */
template <bool SH = false>
__device__ __forceinline__ float k_dot_q3_k(const uint8_t *row, const int8_t *__restrict__ aq,
                                            const float *__restrict__ ad, uint32_t nb, int g)
{
    const int sh = 2 * (g & 3);
    float acc = 0.0f;
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 110 * b;
        uint32_t hm[8], qw[8];
        k_ld8(blk, hm);
        k_ld8(blk + 32 + 32 * (g >> 2), qw);
        /* scales: bytes 0..7 and 8..11 of the 12 packed bytes */
        uint32_t sw[3];
        k_ld3(blk + 96, sw);
        const uint64_t lo8 = (uint64_t)sw[0] | (uint64_t)sw[1] << 32;
        const int isum = k_q3_group<SH>(hm, qw, g, sh, lo8, sw[2], aq + 256 * b + 32 * g);
        acc = sl_emu_q3_k_step(acc, k_half(blk + 108), isum, k_ld_act<SH>(ad + 8 * b + g));
    }
    return acc;
}

/* One lane's share (lane g: group g of every block, as k_dot_q3_k) of row r (0..7) of an
 * 8-row tile in the tiled layout (SL_Q3K_TB; 16-byte aligned, read through L1):
 * sl_emu_dot_q3_k_tb's arithmetic for one row (k_down2's mixed tables). */
__device__ __forceinline__ float k_dot_q3_k_tbrow(const uint8_t *tile, uint32_t r,
                                                  const int8_t *__restrict__ aq,
                                                  const float *__restrict__ ad, uint32_t nb, int g)
{
    const int p = (int)r >> 1, lsh = 4 * (p & 1) + 2 * (int)(r & 1), hsh = (int)r;
    const uint32_t ml = 0x03030303u << lsh, mh = 0x01010101u << hsh;
    const uint8_t *lo = tile + 256 * (p >> 1) + 16 * g, *hi = tile + 512 + 16 * g;
    float acc = 0.0f;
    for (uint32_t b = 0; b < nb; b++) {
        const uint32_t o = SL_Q3K_TB * b;
        const int4 *aw = (const int4 *)(aq + 256 * b + 32 * g);
        int c[2];
#pragma unroll
        for (int v = 0; v < 2; v++) {
            const uint4 l = __ldg((const uint4 *)(lo + o + 128 * v));
            const uint4 h = __ldg((const uint4 *)(hi + o + 128 * v));
            const int4 x = __ldg(aw + v);
            int la = 0, ha = 0;
            la = k_dp4a_us(l.x & ml, x.x, la);
            la = k_dp4a_us(l.y & ml, x.y, la);
            la = k_dp4a_us(l.z & ml, x.z, la);
            la = k_dp4a_us(l.w & ml, x.w, la);
            ha = k_dp4a_us(~h.x & mh, x.x, ha);
            ha = k_dp4a_us(~h.y & mh, x.y, ha);
            ha = k_dp4a_us(~h.z & mh, x.z, ha);
            ha = k_dp4a_us(~h.w & mh, x.w, ha);
            c[v] = (la >> lsh) - 4 * (ha >> hsh);
        }
        const uint32_t l = 8 * p + g;
        const uint32_t z = ((uint32_t)__ldg((const unsigned short *)(tile + o + 768 + 2 * l)) |
                            (uint32_t)__ldg(tile + o + 832 + l) << 16) >>
                           (12 * (r & 1));
        const int isum = ((int)(z & 63u) - 32) * c[0] + ((int)((z >> 6) & 63u) - 32) * c[1];
        const float d =
            __half2float(__ushort_as_half(__ldg((const unsigned short *)(tile + o + 864 + 2 * r))));
        acc = sl_emu_q3_k_step(acc, d, isum, __ldg(ad + 8 * b + g));
    }
    return acc;
}

/* One lane's share of a BF16 row against an f32 activation in shared memory: lane l
 * owns elements i with (i/8) % 32 == l, in increasing i (the router's order). */
__device__ __forceinline__ float k_dot_bf16(const uint16_t *__restrict__ w, const float *a,
                                            uint32_t n, int lane)
{
    float acc = 0.0f;
#pragma unroll 4
    for (uint32_t c = lane; c < n / 8; c += 32) {
        const int4 v = k_ld_stream((const int4 *)(w + 8 * c));
        const float4 a0 = *(const float4 *)(a + 8 * c), a1 = *(const float4 *)(a + 8 * c + 4);
        const uint32_t u[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
        const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float wj = sl_emu_float(j & 1 ? u[j >> 1] & 0xffff0000u : u[j >> 1] << 16);
            acc = sl_emu_fma(av[j], wj, acc);
        }
    }
    return acc;
}

__device__ __forceinline__ float k_butterfly(float v, int from)
{
    for (int off = from; off >= 1; off >>= 1) v = sl_emu_add(v, __shfl_xor_sync(~0u, v, off));
    return v;
}

/* After row r of expert e is done: SwiGLU, then, when this was the 32nd finished row
 * of its q8_1 group, that group's quantization (by whichever warp came last; the
 * values are the same whoever does it). Called by all lanes of the warp. */
__device__ __forceinline__ void k_swiglu_out(float g, float u, float w, float limit, uint32_t e,
                                             uint32_t r, uint32_t inter, const sl_kscratch &s,
                                             bool quant, int lane)
{
    const float h = sl_emu_swiglu(g, u, w, limit);
    if (lane == 0) s.h[(size_t)e * inter + r] = h;
    if (!quant) return;
    const uint32_t grp = e * (inter / 32) + r / 32;
    unsigned old = 0;
    if (lane == 0) {
        __threadfence();
        old = atomicAdd(&s.cnt[grp], 1u);
    }
    old = __shfl_sync(~0u, old, 0);
    if (old != 31) return;
    __threadfence();
    const float v = __ldcg(&s.h[(size_t)grp * 32 + lane]);
    k_quant_h_group(s, grp, v, lane);
    if (lane == 0) s.cnt[grp] = 0;
}

/* Gate and up (Q2_K) of every expert of the table, one row pair per warp step, then
 * SwiGLU, and with FUSEQ the q8_1 quantization of h by the
 * last warp of each group of 32 rows (fence + atomic per row; without it k_quant_h
 * follows, which measured no slower). Persistent: warps stride over the
 * n*inter row pairs. PF: the next step's rows are loaded while this one computes. */
template <int NW, int MAXV, bool PF, bool FUSEQ = false, int MINB = 1>
__global__ void __launch_bounds__(NW * 32, MINB)
    k_gateup_q2_k(const __grid_constant__ sl_ktab tab, const uint16_t *__restrict__ x, uint32_t dim,
                  uint32_t inter, float limit, const __grid_constant__ sl_kscratch s)
{
    extern __shared__ int4 k_smem[];
    int8_t *aq = (int8_t *)k_smem;
    float *ad = (float *)(aq + dim);
    int *as = (int *)(ad + dim / 32);
    int4 *stage = (int4 *)(as + dim / 16); /* dim % 256 == 0 keeps this 16-aligned */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int4 *sg = stage + (size_t)warp * (2 * MAXV * 32 + 2);
    int4 *su = sg + MAXV * 32 + 1;

    k_quant_x<NW>(x, dim, aq, ad, as);
    __syncthreads();

    const uint32_t rb = dim / 256 * 84, nb = dim / 256;
    const uint32_t units = (uint32_t)tab.n * inter, stride = gridDim.x * NW;
    uint32_t u = blockIdx.x * NW + warp;
    int4 vg[MAXV], vu[MAXV];
    const int4 *pg, *pu;
    int ng = 0, nu = 0;
    uint32_t og = 0, ou = 0;
    if (PF && u < units) {
        const uint32_t e = u / inter, r = u % inter;
        const uint8_t *rg = tab.e[e].gate + (size_t)r * rb, *ru = tab.e[e].up + (size_t)r * rb;
        ng = k_span(rg, rb, &pg);
        nu = k_span(ru, rb, &pu);
        og = (uint32_t)((uintptr_t)rg & 15);
        ou = (uint32_t)((uintptr_t)ru & 15);
        k_span_load<MAXV>(vg, pg, ng, lane);
        k_span_load<MAXV>(vu, pu, nu, lane);
    }
    for (; u < units; u += stride) {
        const uint32_t e = u / inter, r = u % inter;
        if (!PF) {
            const uint8_t *rg = tab.e[e].gate + (size_t)r * rb, *ru = tab.e[e].up + (size_t)r * rb;
            ng = k_span(rg, rb, &pg);
            nu = k_span(ru, rb, &pu);
            og = (uint32_t)((uintptr_t)rg & 15);
            ou = (uint32_t)((uintptr_t)ru & 15);
            k_span_load<MAXV>(vg, pg, ng, lane);
            k_span_load<MAXV>(vu, pu, nu, lane);
        }
        __syncwarp();
        k_span_store<MAXV>(vg, sg, ng, lane);
        k_span_store<MAXV>(vu, su, nu, lane);
        __syncwarp();
        const uint32_t cg = og, cu = ou;
        if (PF && u + stride < units) {
            const uint32_t e2 = (u + stride) / inter, r2 = (u + stride) % inter;
            const uint8_t *rg = tab.e[e2].gate + (size_t)r2 * rb,
                          *ru = tab.e[e2].up + (size_t)r2 * rb;
            ng = k_span(rg, rb, &pg);
            nu = k_span(ru, rb, &pu);
            og = (uint32_t)((uintptr_t)rg & 15);
            ou = (uint32_t)((uintptr_t)ru & 15);
            k_span_load<MAXV>(vg, pg, ng, lane);
            k_span_load<MAXV>(vu, pu, nu, lane);
        }
        float g = k_dot_q2_k((const uint8_t *)sg + cg, aq, ad, as, nb, lane);
        float v = k_dot_q2_k((const uint8_t *)su + cu, aq, ad, as, nb, lane);
        g = k_butterfly(g, 16);
        v = k_butterfly(v, 16);
        k_swiglu_out(g, v, tab.e[e].w, limit, (uint32_t)tab.e[e].slot, r, inter, s, FUSEQ, lane);
    }
}

/* ---- gate/up, 4 rows per warp (bench run 5: 31.4 us from HBM vs 36.9, but 0.64 of
 * the zero-copy ceiling vs 0.96, so compute/moe.cu still ships k_gateup_q2_k) ----
 *
 * A lane decodes one half (128 values, 8 qs words) of a Q2_K block with all four
 * 2-bit shifts, so each qs word feeds 4 groups and is read once. The f32 order is
 * still sl_emu_dot_q2_k's: lane n = j + 2m of a row's 8 lanes holds the accumulators
 * of the 32-lane mapping's lanes 4j + s + 8m (s = 0..3: group 4j + s of blocks
 * b = m, m + 4, ... in increasing b), and the butterfly's steps are done in the same
 * tree: xor 16, 8, 4 of the old lanes across lanes (xor 4, 2, 1 here), then xor 2
 * and 1 inside the lane: (a0 + a2) + (a1 + a3). */

/* cp.async of one 16-byte chunk global -> shared (L2 only: weights are read once). */
__device__ __forceinline__ void k_cp16(void *dst, const void *src)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ void k_cp_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N> __device__ __forceinline__ void k_cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Bytes of the padded quantized x (k_quant_x_img's image), rounded up to 16. */
__host__ __device__ inline uint32_t k_gu4_xbytes(uint32_t dim)
{
    return (dim + dim / 8 + dim / 32 * 4 + (dim / 16 + dim / 128) * 4 + 15) / 16 * 16;
}

/* int -> f32, exact for |i| < 2^22 (the group sums: |isum| < 2^19), without the
 * quarter-rate I2F: 1.5 * 2^23 + i has ulp 1, so both steps are exact. */
__device__ __forceinline__ float k_i2f(int i)
{
    return __fsub_rn(__int_as_float(0x4B400000 + i), 12582912.0f);
}

/* The four accumulators (groups 4j + s, s = 0..3) of lane (j, m) of one Q2_K row
 * (row 4-byte aligned in shared memory); see the section comment. NB: nb as a constant
 * (0: nb at run time), the lane's NB / 4 blocks then unrolled. */
template <int NB = 0>
__device__ __forceinline__ void k_dot4_q2_k(const uint8_t *row, const int8_t *aq, const float *ad,
                                            const int *as, uint32_t nb, int j, int m,
                                            float (&acc)[4])
{
    static_assert(NB % 4 == 0, "NB: every lane the same count of blocks");
#pragma unroll
    for (int s = 0; s < 4; s++) acc[s] = 0.0f;
    auto block = [&](uint32_t b) {
        const uint8_t *blk = row + 84 * b;
        const uint32_t *qw = (const uint32_t *)(blk + 16 + 32 * j);
        uint32_t w[8];
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = qw[i];
        const uint32_t scw[2] = {((const uint32_t *)(blk + 8 * j))[0],
                                 ((const uint32_t *)(blk + 8 * j))[1]};
        /* the groups' 4-bit scales and mins, a byte each (group 2s + h: byte 2 (s & 1) + h
         * of word s >> 1) */
        const uint32_t scl[2] = {scw[0] & 0x0f0f0f0fu, scw[1] & 0x0f0f0f0fu};
        const uint32_t mnl[2] = {scw[0] >> 4 & 0x0f0f0f0fu, scw[1] >> 4 & 0x0f0f0f0fu};
        const uint32_t dd = *(const uint32_t *)(blk + 80);
        const float d = __half2float(__ushort_as_half((unsigned short)(dd & 0xffffu)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dd >> 16)));
        const int *asb = as + 16 * b + 8 * j + 4 * (b >> 1); /* padded (k_quant_x) */
        const int4 sa = *(const int4 *)asb, sb = *(const int4 *)(asb + 4);
        const int s16[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
        const float4 d8v = *(const float4 *)(ad + 8 * b + 4 * j);
        const float d8[4] = {d8v.x, d8v.y, d8v.z, d8v.w};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int4 *aw = (const int4 *)(aq + 288 * b + 144 * j + 32 * s); /* padded */
            const int4 a0 = aw[0], a1 = aw[1];
            const uint32_t mk = 0x03030303u << (2 * s); /* the codes in place: k_dp4a_us */
            int c0 = 0, c1 = 0;
            c0 = k_dp4a_us(w[0] & mk, a0.x, c0);
            c0 = k_dp4a_us(w[1] & mk, a0.y, c0);
            c0 = k_dp4a_us(w[2] & mk, a0.z, c0);
            c0 = k_dp4a_us(w[3] & mk, a0.w, c0);
            c1 = k_dp4a_us(w[4] & mk, a1.x, c1);
            c1 = k_dp4a_us(w[5] & mk, a1.y, c1);
            c1 = k_dp4a_us(w[6] & mk, a1.z, c1);
            c1 = k_dp4a_us(w[7] & mk, a1.w, c1);
            c0 >>= 2 * s;
            c1 >>= 2 * s;
            /* sc0 c0 + sc1 c1 and m0 s0 + m1 s1 as two-way dot products of 16-bit halves
             * with bytes (|c| <= 16 * 3 * 127, |s| <= 16 * 127: both fit; exact) */
            const int cc = (int)__byte_perm((unsigned)c0, (unsigned)c1, 0x5410);
            const int ss = (int)__byte_perm((unsigned)s16[2 * s], (unsigned)s16[2 * s + 1], 0x5410);
            const int isum =
                s & 1 ? __dp2a_hi(cc, (int)scl[s >> 1], 0) : __dp2a_lo(cc, (int)scl[s >> 1], 0);
            const int imin =
                s & 1 ? __dp2a_hi(ss, (int)mnl[s >> 1], 0) : __dp2a_lo(ss, (int)mnl[s >> 1], 0);
            /* sl_emu_q2_k_step with the exact fast conversion */
            const float p = sl_emu_mul(d, k_i2f(isum));
            const float v = sl_emu_fma(-dmin, k_i2f(imin), p);
            acc[s] = sl_emu_fma(d8[s], v, acc[s]);
        }
    };
    if (NB) {
#pragma unroll
        for (int i = 0; i < NB / 4; i++) block((uint32_t)(m + 4 * i));
    } else {
        for (uint32_t b = m; b < nb; b += 4) block(b);
    }
}

/* The 32-lane butterfly of sl_emu_dot_q2_k over the 8 lanes of a row holding 4
 * accumulators each (lane n = j + 2m); every lane of the 8 ends with the sum. */
__device__ __forceinline__ float k_comb4(float (&a)[4])
{
#pragma unroll
    for (int off = 4; off >= 1; off >>= 1)
#pragma unroll
        for (int s = 0; s < 4; s++) a[s] = sl_emu_add(a[s], __shfl_xor_sync(~0u, a[s], off));
    return sl_emu_add(sl_emu_add(a[0], a[2]), sl_emu_add(a[1], a[3]));
}

/* ---- bulk-copy (TMA) pipelines: bench run 6 (bench/results/2026-11-30-moe.md) ----
 *
 * One thread of the CTA queues whole row tiles with cp.async.bulk (the copy engine of
 * the SM moves them: no registers, no load instructions per 16 bytes) into stages of
 * shared memory, each with an mbarrier that completes when its bytes have landed; the
 * warps wait on it, compute from shared memory and release the stage at a barrier
 * of the warps that read it, after which one thread queues the tile that reuses it. Tiles are
 * whole rows, so they are contiguous and (rows of 16-byte multiples, tensors 16-byte
 * aligned, checked by the C entries) legal bulk copies. The lane mappings are the ones
 * of k_dot4_q2_k and of the sandbox's k_dot4_q3_k (bench/gpu/moe_sandbox.cuh), so the
 * arithmetic is sl_emu_dot_q2_k's and
 * sl_emu_dot_q3_k's. griddepcontrol.wait (a no-op without programmatic dependent
 * launch) sits after the first copies are queued and before anything the previous
 * kernel of the stream wrote is read or anything is written; the device-table gate/up
 * is the exception (k_gateup_tma_body: x and the selection's table are known complete
 * by other means, and its wait is at its end). */

__device__ __forceinline__ uint32_t k_sa(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void k_mbar_init(uint64_t *bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(k_sa(bar)), "r"(count)
                 : "memory");
}

/* Makes the mbarrier inits visible to the copy engine (before the CTA's __syncthreads). */
__device__ __forceinline__ void k_mbar_fence_init()
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/* Orders this thread's earlier generic-proxy accesses of shared memory (after the
 * CTA barrier: everyone's reads of a stage) before the next bulk copy into it. */
__device__ __forceinline__ void k_fence_proxy()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void k_mbar_expect(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(k_sa(bar)),
                 "r"(bytes)
                 : "memory");
}

/* Bulk copy global -> shared of bytes (multiple of 16, both ends 16-byte aligned),
 * completing on bar. */
__device__ __forceinline__ void k_bulk(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];\n" ::"r"(k_sa(dst)),
        "l"(src), "r"(bytes), "r"(k_sa(bar))
        : "memory");
}

#ifndef SL_GT_MINB /* the bulk-copy gate/ups built for one width: CTAs an SM they ask for */
#define SL_GT_MINB 2
#endif

#ifndef SL_GU_ONE /* an experiment's arm: k_gateup_tma_body's ONE */
#define SL_GU_ONE 0
#endif

#ifndef SL_BULK_EF
#define SL_BULK_EF 3 /* bit 0: the gate/up's weight copies evict-first in L2, bit 1: the down's */
#endif

/* k_bulk for weights, read once a token: with EF, an L2 evict-first hint, so that the
 * streamed tiles leave L2's other lines (h, x, the residual stream) where they are. */
template <bool EF>
__device__ __forceinline__ void k_bulk_w(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    if constexpr (EF) {
        uint64_t pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                     ".L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(k_sa(dst)),
                     "l"(src), "r"(bytes), "r"(k_sa(bar)), "l"(pol)
                     : "memory");
    } else {
        k_bulk(dst, src, bytes, bar);
    }
}

/* Asks L2 to fetch bytes (a multiple of 16) at p (16-byte aligned) from global memory,
 * nothing waiting for them. */
__device__ __forceinline__ void k_prefetch_l2(const void *p, uint32_t bytes)
{
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

/* This CTA's share (of gridDim.x) of the down weights of the table's experts into L2,
 * so that the down launch that follows the gate/up finds them there and HBM stays busy
 * while the gate/up drains (a bench variant, PFD: measured no faster, the down is
 * bound by its decode, not by its loads; docs/kernels.md). */
__device__ __forceinline__ void k_prefetch_downs(const sl_ktab &tab, uint32_t dim, uint32_t inter)
{
    const uint64_t bytes = (uint64_t)dim * (inter / 256 * 110); /* a multiple of 16 */
    const uint64_t lo = bytes * blockIdx.x / gridDim.x & ~(uint64_t)15;
    const uint64_t hi =
        blockIdx.x + 1 == gridDim.x ? bytes : bytes * (blockIdx.x + 1) / gridDim.x & ~(uint64_t)15;
    if (hi > lo)
        for (int x = 0; x < tab.n; x++) k_prefetch_l2(tab.e[x].down + lo, (uint32_t)(hi - lo));
}

__device__ __forceinline__ void k_mbar_wait(uint64_t *bar, uint32_t parity)
{
    uint32_t ok = 0;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok)
                     : "r"(k_sa(bar)), "r"(parity)
                     : "memory");
    } while (!ok);
}

/* Whether the phase of parity `parity` of bar has completed, without waiting. */
__device__ __forceinline__ bool k_mbar_test(uint64_t *bar, uint32_t parity)
{
    uint32_t ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(k_sa(bar)), "r"(parity)
                 : "memory");
    return ok != 0;
}

/* One arrival on bar (release at CTA scope: this thread's and, after a barrier, its
 * group's earlier writes are seen by whoever waits on the phase). */
__device__ __forceinline__ void k_mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(k_sa(bar)) : "memory");
}

/* The start of a bulk-copy pipeline: thread 0 initialises the nbar barriers at bar and
 * queues stages k = 0, 1, ... (at most ST) while queue(k) says it queued one (weights do
 * not depend on the previous kernel); then every thread waits for the previous kernel
 * (PDL; with !wait the caller waits later) and lets the next one start its own.
 * Returns, in thread 0, the stages queued. */
template <int ST, typename F>
__device__ __forceinline__ uint32_t k_pipe_start(uint64_t *bar, int nbar, F &&queue,
                                                 bool wait = true)
{
    uint32_t queued = 0;
    if (threadIdx.x == 0) {
        for (int i = 0; i < nbar; i++) k_mbar_init(bar + i, 1);
        k_mbar_fence_init();
        while (queued < ST && queue(queued)) queued++;
    }
    if (wait) k_pdl_wait();
    k_pdl_go();
    return queued;
}

/* ---- Q2_K on the tensor cores (mma.sync m16n8k32, u8 weights x s8 codes) ----
 *
 * One warp takes a 16-row tile and the blocks b = m, m + 4, ... of its rows, and keeps
 * the f32 accumulators of sl_emu_dot_q2_k's lanes (chunk 4h + s of those blocks) for
 * its two rows and the chunk s = t, so that the rows' sums are the emulation's bits
 * after the butterfly's order is replayed over the warps (k_gateup_tma_body).
 *
 * Only the integer group sums move to the tensor cores. The k dimension of one mma is
 * 8 groups x 4 codes: A's columns 4j..4j+3 are 4 codes of group j of half h (each 4
 * consecutive codes are one qs word masked in place, so a code of level s arrives
 * times 4^s: at most 192, hence u8), and B's column j is the activation codes of group
 * j in rows 4j..4j+3 and zero elsewhere, so that C's column j is group j's sum. Four
 * mmas (codes 4i..4i+3, i = 0..3) complete the 8 groups of a half; lane (g, t) then
 * holds groups 2t, 2t + 1 (chunk 4h + t, both times 4^t) of rows g and g + 8. Of B,
 * a lane holds a non-zero word only where its column is its k group (8 lanes); the
 * others read 16 zero bytes. */
__device__ __forceinline__ void k_mma_u8s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* The f32 step of one chunk from its two group sums c0, c1 (times 4^t: sh = 2t), the
 * block's packed scale bytes sc and the activation's sums s01 of the two groups. */
__device__ __forceinline__ float k_q2_k_chunk(float acc, uint32_t dd, uint32_t sc, int c0, int c1,
                                              int2 s01, float d8, int sh)
{
    const int isum = (int)(sc & 15) * (c0 >> sh) + (int)((sc >> 8) & 15) * (c1 >> sh);
    const int imin = (int)((sc >> 4) & 15) * s01.x + (int)((sc >> 12) & 15) * s01.y;
    const float d = __half2float(__ushort_as_half((unsigned short)(dd & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)(dd >> 16)));
    const float p = sl_emu_mul(d, k_i2f(isum));
    return sl_emu_fma(d8, sl_emu_fma(-dmin, k_i2f(imin), p), acc);
}

/* One warp's accumulators acc[row g / g + 8][h] (chunk 4h + t) over blocks m, m + 4,
 * ... of a 16-row Q2_K tile (rows rb bytes apart, 4-byte aligned, in shared memory);
 * aq, ad, as: k_quant_x's padded layout; zero: 16 zero bytes of shared memory. */
__device__ __forceinline__ void k_mma4_q2_k(const uint8_t *tile, uint32_t rb, const int8_t *aq,
                                            const float *ad, const int *as, const int8_t *zero,
                                            uint32_t nb, uint32_t m, float (&acc)[2][2])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint32_t mlo = 0x03030303u << (2 * (t >> 1)), mhi = mlo << 4;
    const uint8_t *row0 = tile + (size_t)g * rb, *row1 = row0 + 8 * (size_t)rb;
    const bool on0 = g == t, on1 = g == t + 4;
    acc[0][0] = acc[0][1] = acc[1][0] = acc[1][1] = 0.0f;
    for (uint32_t b = m; b < nb; b += 4) {
        const uint8_t *k0 = row0 + 84 * b, *k1 = row1 + 84 * b;
        const uint32_t dd0 = *(const uint32_t *)(k0 + 80), dd1 = *(const uint32_t *)(k1 + 80);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint32_t *q0 = (const uint32_t *)(k0 + 16 + 32 * h + 16 * (t & 1));
            const uint32_t *q1 = (const uint32_t *)(k1 + 16 + 32 * h + 16 * (t & 1));
            const int8_t *ap = aq + 288 * b + 144 * h + 16 * g; /* padded */
            const int4 v0 = *(const int4 *)(on0 ? ap : zero);
            const int4 v1 = *(const int4 *)(on1 ? ap : zero);
            const uint32_t b0[4] = {(uint32_t)v0.x, (uint32_t)v0.y, (uint32_t)v0.z, (uint32_t)v0.w};
            const uint32_t b1[4] = {(uint32_t)v1.x, (uint32_t)v1.y, (uint32_t)v1.z, (uint32_t)v1.w};
            int c[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t w0 = q0[i], w1 = q1[i];
                k_mma_u8s8(c, w0 & mlo, w1 & mlo, w0 & mhi, w1 & mhi, b0[i], b1[i]);
            }
            const int2 s01 = *(const int2 *)(as + 16 * b + 8 * h + 2 * t + 4 * (b >> 1));
            const float d8 = ad[8 * b + 4 * h + t];
            const uint32_t sc0 = *(const unsigned short *)(k0 + 8 * h + 2 * t);
            const uint32_t sc1 = *(const unsigned short *)(k1 + 8 * h + 2 * t);
            acc[0][h] = k_q2_k_chunk(acc[0][h], dd0, sc0, c[0], c[1], s01, d8, 2 * t);
            acc[1][h] = k_q2_k_chunk(acc[1][h], dd1, sc1, c[2], c[3], s01, d8, 2 * t);
        }
    }
}

/* The activation x quantized once into global memory in k_quant_x's padded layout
 * (k_gu4_xbytes(dim) bytes, 16-byte aligned), which the bulk-copy gate/up copies into
 * shared memory instead of quantizing x in every CTA. One warp a block of 32. */
__global__ void __launch_bounds__(256)
    k_quant_x_img(const uint16_t *__restrict__ x, uint32_t dim, uint8_t *__restrict__ img)
{
    k_pdl_go(); /* the gate/up may queue its weights meanwhile */
    k_pdl_wait();
    int8_t *aq = (int8_t *)img;
    float *ad = (float *)(aq + dim + dim / 8);
    int *as = (int *)(ad + dim / 32);
    const int lane = threadIdx.x & 31;
    const uint32_t b = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (b < dim / 32)
        k_quant_block<true>(sl_emu_bf16_to_f32(x[32 * b + lane]), b, lane, aq, ad, as);
}

/* Bytes of one stage of k_gateup_tma_q2_k: TR rows of gate and TR rows of up. */
__host__ __device__ inline uint32_t k_gut_stage(uint32_t dim, int tr)
{
    return 2u * (uint32_t)tr * (dim / 256 * 84);
}

/* The split stage layout (SPL): the ST stages' gate tiles, then this gap, then their up
 * tiles, so that a stage's up tile starts ST TR rb + 64 bytes from its gate tile: 64 past
 * a multiple of 128 whenever ST TR is a multiple of 32 (compute/'s ST 4, TR 8: 2688 nb
 * bytes, 21 nb lines). At dim 5120 a gate row and the up row of the same lanes then fall
 * in other banks: in one stage of TR rows each (13440 bytes, 105 lines) they fall in the
 * same, and every weight load of the unit is a 2-way conflict (k_gateup_dp4a_unit's
 * lanes). */
#define SL_GU_SPLIT_GAP 64

/* Queues TR rows of gate and TR of up of expert x from row r0 (rb bytes a row) into the
 * stage at dst (gate) and dst + upoff (up), gate's first, completing on b. */
template <int TR, typename X>
__device__ __forceinline__ void k_issue_gu_rows(uint8_t *dst, uint64_t *b, const X &x, uint32_t r0,
                                                uint32_t rb, uint32_t upoff)
{
    k_mbar_expect(b, 2 * TR * rb);
    k_bulk_w<(SL_BULK_EF & 1) != 0>(dst, x.gate + (size_t)r0 * rb, TR * rb, b);
    k_bulk_w<(SL_BULK_EF & 1) != 0>(dst + upoff, x.up + (size_t)r0 * rb, TR * rb, b);
}

/* The start of a gate/up pipeline (k_pipe_start over nbar barriers): without DEV,
 * queue(k) for the first ST stages; with DEV (the table comes from the kernel before),
 * only those whose unit (unit(k)) is the shared expert's, when it takes the first tpe
 * units (sh_first), through shared(k, r0). first() comes before them all. Returns, in
 * thread 0, the mask of the stages k < ST queued. */
template <int ST, int TR, bool DEV, typename Q, typename S, typename X, typename U>
__device__ __forceinline__ uint32_t k_gu_pipe_start(uint64_t *bar, int nbar, int sh_first,
                                                    uint32_t tpe, Q &&queue, S &&shared, X &&first,
                                                    U &&unit, bool wait = true)
{
    static_assert(ST <= 32, "a mask of the stages");
    uint32_t mask = 0;
    k_pipe_start<ST>(
        bar, nbar,
        [&](uint32_t k) {
            if (k == 0) first();
            if (!DEV) {
                queue(k);
                mask |= 1u << k;
            } else if (sh_first && unit(k) < tpe) {
                shared(k, unit(k) * TR);
                mask |= 1u << k;
            }
            return true;
        },
        wait);
    return mask;
}

/* The default order of a persistent kernel's units: CTA c takes c, c + grid, ... */
struct k_unit_rr {
    __device__ uint32_t operator()(uint32_t k) const
    {
        return blockIdx.x + k * gridDim.x;
    }
};

/* Thread 0: the bulk copy of x's image (k_quant_x_img's bytes) into aq, on xbar. */
__device__ __forceinline__ void k_ximg_load(void *aq, const uint8_t *ximg, uint32_t dim,
                                            uint64_t *xbar)
{
    k_mbar_expect(xbar, k_gu4_xbytes(dim));
    k_bulk(aq, ximg, k_gu4_xbytes(dim), xbar);
}

/* The group's named barrier (id 0 is __syncthreads'). */
template <int NW> __device__ __forceinline__ void k_group_bar(int grp)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + grp), "n"(NW * 32) : "memory");
}

/* One unit (16 rows of gate, 16 of up, in stage st) on the tensor cores: warp w takes
 * tile w & 1 (gate, up) and block set m = w >> 1 (k_mma4_q2_k); the partial sums meet
 * in red, where 128 threads replay sl_emu_dot_q2_k's butterfly (for each s: over m as
 * its xor 16 and 8, over h as its xor 4; then over s as its xor 2 and 1 by shuffles)
 * and SwiGLU the 16 rows into h. Barriers: red is free (the previous unit's
 * reduction is done), then red is full and the stage read. */
template <int NW, typename E, typename F>
__device__ __forceinline__ void
k_gateup_mma_unit(const uint8_t *st, uint32_t rb, uint32_t nb, const int8_t *aq, const float *ad,
                  const int *as, const int8_t *zero, float4 *red, int grp, int warp, int lane,
                  const E &ex, float *h, float limit, F &&stage_free)
{
    float acc[2][2];
    k_mma4_q2_k(st + (warp & 1) * 16 * rb, rb, aq, ad, as, zero, nb, (uint32_t)warp >> 1, acc);
    k_group_bar<NW>(grp);
    red[warp * 32 + lane] = make_float4(acc[0][0], acc[0][1], acc[1][0], acc[1][1]);
    k_group_bar<NW>(grp);
    if (warp == 0 && lane == 0) stage_free();
    if (warp >= 4) return;
    /* thread i = s + 4 * tile + 8 * r: row r of the tile, chunk s */
    const int i = warp * 32 + lane, s = i & 3, tile = (i >> 2) & 1, r = i >> 3;
    const float *x = (const float *)(red + 4 * (r & 7) + s) + 2 * (r >> 3); /* x[h] at +h */
    float v[2]; /* per h: (m0 + m2) + (m1 + m3) */
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const float x0 = x[(tile + 0) * 128 + hh], x1 = x[(tile + 2) * 128 + hh];
        const float x2 = x[(tile + 4) * 128 + hh], x3 = x[(tile + 6) * 128 + hh];
        v[hh] = sl_emu_add(sl_emu_add(x0, x2), sl_emu_add(x1, x3));
    }
    float sum = sl_emu_add(v[0], v[1]);
    sum = sl_emu_add(sum, __shfl_xor_sync(~0u, sum, 2));
    sum = sl_emu_add(sum, __shfl_xor_sync(~0u, sum, 1));
    const float up = __shfl_xor_sync(~0u, sum, 4);
    if ((i & 7) == 0) h[r] = sl_emu_swiglu(sum, up, ex.w, limit);
}

/* One unit with dp4a: each warp step is the sandbox's k_gateup4_q2_k's (rows r, r + 1 of gate and
 * up, 8 lanes a row); then the group's barrier frees the stage. Returns, in lanes 0
 * and 16, the h of row 2p + lane / 16 of the warp's last step p. */
template <int NW, int TR, int NG, int NB = 0, typename E, typename F>
__device__ __forceinline__ float
k_gateup_dp4a_unit(const uint8_t *st, uint32_t upoff, uint32_t rb, uint32_t nb, const int8_t *aq,
                   const float *ad, const int *as, int grp, int warp, int lane, const E &ex,
                   float *h, float limit, F &&stage_free)
{
    const int t = lane >> 3, n = lane & 7;
    float hv = 0.0f;
    for (int p = warp; p < TR / 2; p += NW) {
        const uint8_t *row = st + (t & 1) * upoff + (2 * p + (t >> 1)) * rb;
        float a[4];
        k_dot4_q2_k<NB>(row, aq, ad, as, nb, n & 1, n >> 1, a);
        const float v = k_comb4(a);
        const float o = __shfl_xor_sync(~0u, v, 8); /* gate lanes get their up */
        if ((lane & 15) == 0) {
            hv = sl_emu_swiglu(v, o, ex.w, limit);
            h[2 * p + (lane >> 4)] = hv;
        }
    }
    if (NG == 1)
        __syncthreads();
    else
        k_group_bar<NW>(grp);
    if (warp == 0 && lane == 0) stage_free();
    return hv;
}

/* q8_1 of the group of 32 rows of h that holds rows [r0, r0 + TR) of slot's expert, by
 * one warp of each of the group's units once the unit's rows are written and its warps
 * met at a barrier: the units count themselves in s.cnt, and the warp of the last one
 * quantizes the group (k_q8_lane, the bits of k_quant_h) and puts its count back to 0.
 * Lane 0's fence before the count publishes the unit's rows (the barrier orders its
 * warps' stores before it), its fence after the last count orders the others' rows
 * before the group's loads, which bypass L1. */
template <int TR>
__device__ __forceinline__ void k_quant_h_last(const sl_kscratch &s, int slot, uint32_t inter,
                                               uint32_t r0, int lane)
{
    static_assert(32 % TR == 0, "a unit's rows lie in one q8_1 group");
    const uint32_t g = (uint32_t)slot * (inter / 32) + r0 / 32;
    unsigned old = 0;
    if (lane == 0) {
        __threadfence();
        old = atomicAdd(&s.cnt[g], 1u);
    }
    if (__shfl_sync(~0u, old, 0) != 32 / TR - 1) return;
    if (lane == 0) {
        __threadfence();
        s.cnt[g] = 0; /* every unit of the group has counted: ready for the next launch */
    }
    __syncwarp();
    k_quant_h_group(s, g, __ldcg(&s.h[(size_t)g * 32 + lane]), lane);
}

/* The device-table gate/up's copy of a table written in device memory (the selection's
 * untagged form): the gate/up's part of each entry. */
__device__ __forceinline__ void k_tab_take(sl_kgutab &dst, const sl_ktab &src)
{
    dst.n = src.n;
    for (int i = 0; i < SL_GPU_MAX_USED; i++)
        dst.e[i] = sl_kgu{src.e[i].gate, src.e[i].up, src.e[i].w, src.e[i].slot};
}

/* The producer warp's lane 0 of a PW gate/up: STG, each group's other first stages once
 * its first one landed; then the refills, unit k into stage k % ST once its unit k - ST
 * was read (the (k / ST)-th phase of empty[k % ST]), the groups in turn so that a slow
 * group holds up no other's, until no group has a unit left. rec(g): group g's record,
 * where the time spent queueing is summed (slots 24, 25), or NULL. */
template <int ST, int NG, bool STG, typename U, typename I, typename R>
__device__ __forceinline__ void k_gu_produce(uint64_t *bar, uint64_t *empty, uint32_t units,
                                             U &&unit, I &&issue, R &&rec)
{
    if (STG)
        for (uint32_t g = 0; g < NG; g++) {
            if (unit(g) >= units) continue;
            k_mbar_wait(bar + g, 0);
            for (uint32_t q = g + NG; q < ST; q += NG) issue(q);
        }
    uint32_t next[NG], live = 0;
#pragma unroll
    for (int g = 0; g < NG; g++) {
        next[g] = ST + g;
        live += unit(next[g]) < units;
    }
    while (live) {
        bool any = false;
#pragma unroll
        for (int g = 0; g < NG; g++) {
            const uint32_t k = next[g];
            if (unit(k) >= units || !k_mbar_test(empty + k % ST, (k / ST - 1) & 1)) continue;
            unsigned long long *r = rec(g);
            const unsigned long long q0 = r ? k_globaltimer() : 0;
            issue(k);
            if (r) k_stamp_add(r, q0);
            next[g] = k + NG;
            live -= unit(next[g]) >= units;
            any = true;
        }
        if (!any) __nanosleep(64);
    }
}

/* Gate and up (Q2_K) of every expert of the table, then SwiGLU into s.h (QH: and its
 * q8_1, k_quant_h_last, the warp of each unit after it (1) or the CTA's warps, a unit
 * each, at its end (2); or (3) each q8_1 group of h by the warp group that computed
 * its rows (below); else k_quant_h follows). Persistent: CTA c
 * takes the units u = c, c + grid, ..., a unit being rows [r0, r0 + TR) of gate and up
 * of one expert, ST units in flight; with QH 3 group G takes the q8_1 groups (32 / TR
 * units each, "chunks") G * grid + c, (G + NG) * grid + c, ..., each chunk's units in
 * turn, holds the h of its rows in registers and, after the chunk's last unit, writes
 * them into that unit's stage (read in full by then), quantizes them with one warp
 * (k_quant_h's bits) and only then frees the stage: no global round trip, no fence;
 * with QH 4 CTA c takes the chunks c, c + grid, ..., group G units [G * PG, G * PG + PG)
 * of each, the groups meet at a CTA barrier after each chunk, and group 0's warp 0
 * quantizes the rows from both groups' stages, then frees them. NG groups of NW
 * warps compute NG units at once (group G the CTA's units k = G mod NG, with its own named
 * barrier), so that more warps per SM hide the decode's latency. x arrives quantized (ximg:
 * k_quant_x_img's bytes, one bulk copy). A unit is decoded with dp4a (k_gateup_dp4a_unit) or, MMA,
 * on the tensor cores (k_gateup_mma_unit, a bench variant). DEV: the table is read from device
 * memory after the wait for the kernel before (the selection), or, with ttab, from the tagged
 * table the selection wrote with tag `tag`, the wait for its grid then coming at the end; with
 * sh_first the shared expert sh, the table's last entry, takes the first units (unit u: entry (u /
 * tpe + n - 1) % n), so that its first stages (and x) are queued before that wait. STG: the
 * host-table form's staggered start. STAMP: the form that records milestones (s.stamps). TR % 4 ==
 * 0 keeps a tile a multiple of 16 bytes for every dim % 256 == 0; ST % NG == 0 keeps a stage within
 * one group. NB (not 0): dim is 256 NB exactly, so a lane's blocks are a constant count, unrolled
 * (the kernels then ask for 2 CTAs an SM: 128 registers at most). SPL: the split stage layout
 * (SL_GU_SPLIT_GAP; the dp4a unit only). PW: a producer warp (the CTA's last, NG NW 32 + 32
 * threads) queues every stage past the first ones: a unit's group frees its stage with one
 * arrival on the stage's `empty` barrier, so no computing warp waits in cp.async.bulk while
 * the memory is busy (k_gu_produce). TAB: sl_ktab, or the device-table form's sl_kgutab. */
template <int NW, int TR, int ST, int NG, bool MMA, bool DEV, bool PFD, bool STG, bool STAMP,
          int QH = 0, int NB = 0, bool SPL = false, bool PW = false, typename TAB>
__device__ __forceinline__ void
k_gateup_tma_body(const TAB &tab, TAB *tab_dst, const sl_ktab *tabp, const sl_kttab *ttab,
                  unsigned tag, const sl_kexp &sh, int sh_first, const uint8_t *__restrict__ ximg,
                  uint32_t dim, uint32_t inter, float limit, const sl_kscratch &s)
{
    static_assert(ST % NG == 0, "stages are split evenly between the groups");
    static_assert(!MMA || (NW == 8 && TR == 16), "mma: 2 tiles x 4 block sets = 8 warps");
    static_assert(!PW || (!MMA && !PFD && NG > 1 && (QH == 0 || QH >= 3)),
                  "PW: the dp4a units, their stages freed at a group's barrier");
    static_assert(!(MMA && QH == 1), "the mma unit writes h after its last barrier");
    extern __shared__ int4 k_smem[];
    int8_t *aq = (int8_t *)k_smem;             /* [dim + dim/8] padded codes */
    float *ad = (float *)(aq + dim + dim / 8); /* [dim/32] */
    int *as = (int *)(ad + dim / 32);          /* [dim/16 + dim/128] padded sums */
    uint8_t *stage = (uint8_t *)k_smem + k_gu4_xbytes(dim);
    static_assert(!NB || !MMA, "NB: the dp4a unit's blocks");
    static_assert(!SPL || !MMA, "the split layout: the dp4a unit's rows");
    const uint32_t nb = NB ? NB : dim / 256, rb = nb * 84, sb = k_gut_stage(dim, TR);
    /* stage k's gate tile at stage + k gs, its up tile upoff further */
    const uint32_t gs = SPL ? TR * rb : sb, upoff = SPL ? ST * TR * rb + SL_GU_SPLIT_GAP : TR * rb;
    uint64_t *bar = (uint64_t *)(stage + (size_t)ST * sb + (SPL ? SL_GU_SPLIT_GAP : 0));
    const uint32_t tpe = inter / TR, grid = gridDim.x;
    const int lane = threadIdx.x & 31, grp = threadIdx.x / (NW * 32),
              warp = (threadIdx.x >> 5) % NW;
    const bool prod = PW && grp == NG; /* the producer warp */
    /* ONE: QH 3, 4's units through one call of the unit (its unrolled code once, not twice
     * in the instruction cache) */
    constexpr bool ONE = SL_GU_ONE != 0;
    uint32_t units = 0, rot = 0; /* unit u: rows (u % tpe) * TR of entry (u / tpe + rot) % n */
    /* QH 3, 4: a chunk is the CH units of one q8_1 group of h; a group takes PG of them
     * (3: all, 4: group G the G-th part of its CTA's chunk) */
    constexpr int CH = 32 / TR, PG = QH == 4 ? CH / NG : CH;
    static_assert(QH < 3 || (!MMA && TR / 2 == NW && 32 % TR == 0 && PG * NG % CH == 0 && PG > 0),
                  "QH 3, 4: a warp holds one row pair of each unit, a chunk splits evenly");
    auto unit = [&](uint32_t k)
        -> uint32_t {                                        /* the CTA's k-th unit */
                      const uint32_t g = k % NG, i = k / NG; /* group g's i-th unit */
                      if (QH == 3) return CH * ((g + i / PG * NG) * grid + blockIdx.x) + i % PG;
                      if (QH == 4) return CH * (blockIdx.x + i / PG * grid) + g * PG + i % PG;
                      return blockIdx.x + k * grid;
    };

    /* queues rows r0.. of expert x into stage k % ST */
    auto issue_rows = [&](uint32_t k, const auto &x, uint32_t r0) {
        k_issue_gu_rows<TR>(stage + (size_t)(k % ST) * gs, bar + k % ST, x, r0, rb, upoff);
    };
    bool pfd = !PFD; /* PFD: group 0's first issue past the units prefetches the downs */
    auto issue = [&](uint32_t k) { /* the CTA's k-th unit into stage k % ST */
                                   const uint32_t u = unit(k);
                                   if (u >= units) {
                                       if constexpr (PFD)
                                           if (!pfd && grp == 0) k_prefetch_downs(tab, dim, inter);
                                       pfd = true;
                                       return;
                                   }
                                   issue_rows(k, tab.e[(u / tpe + rot) % tab.n], (u % tpe) * TR);
    };
    uint64_t *xbar = bar + ST;  /* the quantized x (k_quant_x_img) has landed */
    uint64_t *empty = xbar + 1; /* PW: stage k's unit read (one arrival a unit) */
    /* mma: each group's partial sums (a float4 per lane of its 8 warps), 16 zero bytes */
    float4 *red0 = (float4 *)(((uintptr_t)(empty + (PW ? ST : 0)) + 15) & ~(uintptr_t)15);
    float4 *red = red0 + grp * NW * 32;
    int8_t *zero = (int8_t *)(red0 + NG * NW * 32);
    unsigned long long *rec =
        STAMP && !prod ? k_stamp_rec(s.stamps, NG, grp, threadIdx.x % (NW * 32) == 0) : nullptr;
    k_stamp(rec, 0);
    if (STAMP && rec) rec[24] = rec[25] = 0; /* this launch's refills only */
    bool x26_late = false; /* DEV, STAMP, thread 32: x landed after the table was read */
    auto stamp_x26 = [&] { k_stamp(k_stamp_rec(s.stamps, NG, 0, true), 26); }; /* x landed */
    auto stamp_x26_late = [&] {
        if (STAMP && x26_late) stamp_x26();
    };
    /* DEV: the table comes from the kernel before (k_route_select). The shared expert,
     * known at launch, takes the first units when sh_first, so its first stages load
     * while the selection runs. STG: one stage a group at first, the group's others
     * once it landed (fewer bytes ahead of every CTA's first stage). */
    if (!DEV) units = (uint32_t)tab.n * tpe;
    /* DEV: x's image first, before the wait for the selection. It comes from the router
     * (k_router_pf, or k_quant_x_img before it), which completed before the selection's
     * own wait returned, and this kernel starts only after that (the selection lets it
     * start right after its wait): the bytes are complete. Then the x it needs first
     * lands first, with the shared expert's stages, while the selection runs. */
    const uint32_t early = k_gu_pipe_start<(STG ? NG : ST), TR, DEV>(
        bar, ST + 1 + (PW ? ST : 0) /* and xbar, PW: the empty barriers */, sh_first, tpe, issue,
        [&](uint32_t k, uint32_t r0) { issue_rows(k, sh, r0); },
        [&] {
            if (DEV) k_ximg_load(aq, ximg, dim, xbar);
        },
        unit, !ttab);
    /* ... which waits for k_quant_x_img (or the router, or the selection; with ttab,
     * the selection's table is waited for here and its grid at the end) */
    if constexpr (DEV) { /* (the host-table forms' sl_ktab never takes a table) */
        static_assert(SL_KTT_WORDS <= 32, "warp 0 reads the tagged table, a word a lane");
        static_assert(!(DEV && PFD), "the tagged table carries no down pointers to prefetch");
        /* when x lands, not bounded by the table's read: thread 32 watches x until the
         * table is read, and stamps later (x26_late) if x has not landed by then, so that
         * the stamped form does not hold the CTA's table barrier for x */
        __shared__ volatile int tab_read;
        if (STAMP && s.stamps) {
            if (threadIdx.x == 0) tab_read = 0;
            __syncthreads(); /* the barriers' inits, the flag */
            if (threadIdx.x == 32) {
                bool x26 = false;
                while (!(x26 = k_mbar_test(xbar, 0)) && !tab_read) __nanosleep(32);
                if (x26)
                    stamp_x26();
                else
                    x26_late = true;
            }
        }
        if (!ttab) {
            if (threadIdx.x == 0) {
                k_tab_take(*tab_dst, *tabp); /* tab is *tab_dst */
                if (STAMP) tab_read = 1;
            }
        } else if (threadIdx.x < 32) { /* the selection's tagged table (k_route_select),
                                        * written before its host writes and their fence;
                                        * the wait for its grid comes at the end */
            const unsigned long long t0 = k_globaltimer();
            for (;;) { /* every word of the table and its header current, in one round */
                const unsigned long long v =
                    lane < SL_KTT_WORDS ? k_ld_relaxed64(ttab->w + lane) : 0ull;
                const unsigned long long hdr = __shfl_sync(~0u, v, 0);
                const uint32_t n = (uint32_t)(hdr >> 4) & 15u;
                const bool ok = (hdr & 15u) == tag && n <= SL_GPU_MAX_USED &&
                                ((uint32_t)lane >= 1 + 3 * n || (v & 15u) == tag);
                if (__all_sync(~0u, ok)) {
                    k_stamp(rec, 28);
                    if (lane == 0) {
                        tab_dst->n = (int)n;
                        if (STAMP) tab_read = 1;
                    }
                    if (lane >= 1 && (uint32_t)lane < 1 + 3 * n) {
                        auto &x = tab_dst->e[(lane - 1) / 3];
                        const unsigned long long p = v & ~15ull;
                        if ((lane - 1) % 3 == 0) x.gate = (const uint8_t *)p;
                        if ((lane - 1) % 3 == 1) x.up = (const uint8_t *)p;
                        if ((lane - 1) % 3 == 2) {
                            x.w = __uint_as_float((unsigned)(v >> 32));
                            x.slot = (int)((uint32_t)v >> 4);
                        }
                    }
                    break;
                }
                __nanosleep(32);
                /* a table that never comes (a selection queued without ttab) is a trap
                 * after 2 s, not a hang */
                if (k_globaltimer() - t0 > 2000000000ull) __trap();
            }
        }
        __syncthreads();
        units = (uint32_t)tab.n * tpe;
        rot = sh_first ? (uint32_t)tab.n - 1 : 0;
        if (unit(0) >= units) { /* only x was queued (early units are < units) */
            k_mbar_wait(xbar, 0);
            stamp_x26_late();
            if (ttab) k_pdl_wait();
            return;
        }
        if (threadIdx.x == (PW ? NG * NW * 32 : 0)) {
            /* PW: the producer, which knows the early stages by the rule that queued them */
            for (uint32_t k = 0; k < (STG ? NG : ST); k++)
                if (PW ? !(sh_first && unit(k) < tpe) : !(early >> k & 1)) issue(k);
            k_stamp(PW ? k_stamp_rec(s.stamps, NG, 0, STAMP) : rec, 27);
        }
    }
    if (threadIdx.x == 0) {
        if (MMA) *(int4 *)zero = make_int4(0, 0, 0, 0);
        if (!DEV) k_ximg_load(aq, ximg, dim, xbar);
    }
    __syncthreads(); /* the barriers' inits (non-DEV: the only CTA barrier before the
                      * waits on them) and the zero bytes */
    if (prod) {      /* the producer queues the rest and ends with the others */
        if (lane == 0)
            k_gu_produce<ST, NG, STG>(bar, empty, units, unit, issue,
                                      [&](int g) { return k_stamp_rec(s.stamps, NG, g, STAMP); });
        __syncwarp();
        if (ttab) k_pdl_wait();
        return;
    }
    k_mbar_wait(xbar, 0);
    stamp_x26_late();
    k_stamp(rec, 1);

    uint32_t i = 0;                  /* the group's units done */
    float held[PG > 1 ? PG - 1 : 1]; /* QH 3, 4: lanes 0, 16: the h of the group's units so far */
    /* QH 3, 4: the group's i-th unit's h kept, a unit before its chunk's last */
    auto hold = [&](float hv) {
#pragma unroll
        for (int m = 0; m < PG - 1; m++)
            if (i % PG == (uint32_t)m) held[m] = hv;
    };
    for (uint32_t k = grp; unit(k) < units; k += NG, i++) {
        const uint32_t u = unit(k), r0 = (u % tpe) * TR;
        const auto &ex = tab.e[(u / tpe + rot) % tab.n];
        k_mbar_wait(bar + k % ST, (k / ST) & 1);
        k_stamp_unit(rec, i, 0);
        if (STG && !PW && k < NG && threadIdx.x % (NW * 32) == 0) /* the group's other stages */
            for (uint32_t q = k + NG; q < ST; q += NG) issue(q);
        const uint8_t *st = stage + (size_t)(k % ST) * gs;
        float *h = s.h + (size_t)ex.slot * inter + r0;
        auto stage_free = [&] {
            k_fence_proxy();
            if constexpr (PW) {
                k_mbar_arrive(empty + k % ST);
            } else {
                const unsigned long long q0 = STAMP && rec ? k_globaltimer() : 0;
                issue(k + ST);
                if (STAMP && rec) k_stamp_add(rec, q0);
            }
        };
        if (MMA) {
            k_gateup_mma_unit<NW>(st, rb, nb, aq, ad, as, zero, red, grp, warp, lane, ex, h, limit,
                                  stage_free);
        } else if (!(ONE && QH >= 3) && (QH < 3 || i % PG != PG - 1)) {
            const float hv = k_gateup_dp4a_unit<NW, TR, NG, NB>(
                st, upoff, rb, nb, aq, ad, as, grp, warp, lane, ex, h, limit, stage_free);
            if (QH >= 3) hold(hv);
        } else { /* the group's last unit of the chunk: the stages are freed after the q8_1
                  * (ONE: every unit of QH 3, 4 here, through one copy of the unit's code) */
            const bool last = i % PG == PG - 1;
            const float hv =
                ONE ? k_gateup_dp4a_unit<NW, TR, NG, NB>(st, upoff, rb, nb, aq, ad, as, grp, warp,
                                                         lane, ex, h, limit,
                                                         [&] {
                                                             if (!last) stage_free();
                                                         })
                    : k_gateup_dp4a_unit<NW, TR, NG, NB>(st, upoff, rb, nb, aq, ad, as, grp, warp,
                                                         lane, ex, h, limit, [] {});
            if (ONE && !last) {
                hold(hv);
                k_stamp_unit(rec, i, 1);
                continue;
            }
            float *hs = (float *)(stage + (size_t)(k % ST) * gs); /* read in full by now */
            if ((lane & 15) == 0) {
                const int r = 2 * warp + (lane >> 4);
#pragma unroll
                for (int m = 0; m < PG - 1; m++) hs[m * TR + r] = held[m];
                hs[(PG - 1) * TR + r] = hv;
                k_fence_proxy(); /* before the stage's next bulk copy, whoever queues it */
            }
            /* QH 4: the CTA's groups at once (each CTA's groups take the same chunks) */
            if (QH == 3)
                k_group_bar<NW>(grp);
            else if (PW) /* the computing warps (the producer is elsewhere) */
                asm volatile("bar.sync %0, %1;\n" ::"r"(1 + NG), "n"(NG * NW * 32) : "memory");
            else
                __syncthreads();
            if (warp == 0 && (QH == 3 || grp == 0)) {
                const uint32_t uu = (uint32_t)lane / TR; /* the chunk's unit of row lane */
                const float v =
                    ((const float *)(stage + (size_t)((k + uu / PG) % ST) *
                                                 gs))[uu % PG * TR +
                                                      lane % TR]; /* QH 4: group uu / PG's stage */
                __syncwarp();
                if (lane == 0) {
                    k_fence_proxy();
                    const unsigned long long q0 = STAMP && rec && !PW ? k_globaltimer() : 0;
                    for (uint32_t gg = 0; gg < (QH == 4 ? NG : 1); gg++)
                        if (PW)
                            k_mbar_arrive(empty + (k + gg) % ST);
                        else
                            issue(k + gg + ST);
                    if (STAMP && rec && !PW) k_stamp_add(rec, q0);
                }
                k_quant_h_group(s, (uint32_t)ex.slot * (inter / 32) + (r0 - (PG - 1) * TR) / 32, v,
                                lane);
            }
        }
        if (QH == 1 && warp == NW - 1) k_quant_h_last<TR>(s, ex.slot, inter, r0, lane);
        k_stamp_unit(rec, i, 1);
    }
    if (QH == 2) { /* at the CTA's end: warp w counts the CTA's units w, w + NG * NW, ... */
        __syncthreads();
        for (uint32_t k = threadIdx.x >> 5; blockIdx.x + k * grid < units; k += NG * NW) {
            const uint32_t u = blockIdx.x + k * grid;
            k_quant_h_last<TR>(s, tab.e[(u / tpe + rot) % tab.n].slot, inter, (u % tpe) * TR, lane);
        }
    }
    k_stamp_end(rec, i);
    if (ttab) k_pdl_wait(); /* the selection's end comes before this kernel's */
    k_stamp(rec, 29);
}

/* STAMP: the form that records milestones (s.stamps); the others have no trace of them.
 * QH: h's q8_1 too (s.cnt zero at launch, and left so), counted after each unit (1) or
 * at the CTA's end (2), or (3) each group of 32 rows by the warp group that computed
 * them (no counters). */
template <int NW, int TR, int ST, int NG = 1, bool MMA = false, bool PFD = false, bool STG = false,
          bool STAMP = false, int QH = 0, int NB = 0, bool SPL = false, bool PW = false>
__global__ void __launch_bounds__(NG *NW * 32 + (PW ? 32 : 0), NB ? SL_GT_MINB : 1)
    k_gateup_tma_q2_k(const __grid_constant__ sl_ktab tab, const uint8_t *__restrict__ ximg,
                      uint32_t dim, uint32_t inter, float limit,
                      const __grid_constant__ sl_kscratch s)
{
    k_gateup_tma_body<NW, TR, ST, NG, MMA, false, PFD, STG, STAMP, QH, NB, SPL, PW>(
        tab, (sl_ktab *)NULL, NULL, NULL, 0, tab.e[0], 0, ximg, dim, inter, limit, s);
}

/* The same with the table in device memory, written by the kernel before it on the
 * stream (k_route_select: the experts the device tier holds, then the shared expert sh
 * when sh_first, whose units then come first), read from its tagged form ttab as soon
 * as its words carry the selection's tag `tag` (NULL: the kernel waits for the selection's grid
 * and reads tabp instead); launched for the most experts a
 * token may have, the CTAs beyond the table's units return at once. tabp is not
 * restrict: the read-only path may hold an older layer's table. */
template <int NW, int TR, int ST, int NG = 1, bool MMA = false, bool PFD = false, bool STG = false,
          bool STAMP = false, int QH = 0, int NB = 0, bool SPL = false, bool PW = false>
__global__ void __launch_bounds__(NG *NW * 32 + (PW ? 32 : 0), NB ? SL_GT_MINB : 1)
    k_gateup_tma_dev_q2_k(const sl_ktab *tabp, const uint8_t *__restrict__ ximg, uint32_t dim,
                          uint32_t inter, float limit, const __grid_constant__ sl_kscratch s,
                          const __grid_constant__ sl_kexp sh, int sh_first, const sl_kttab *ttab,
                          unsigned tag)
{
    __shared__ sl_kgutab tab;
    k_gateup_tma_body<NW, TR, ST, NG, MMA, true, PFD, STG, STAMP, QH, NB, SPL, PW>(
        tab, &tab, tabp, ttab, tag, sh, sh_first, ximg, dim, inter, limit, s);
}

/* ng, nw: the mma form's partial sums and zero bytes (ng = 0: the dp4a form); spl: the
 * split stage layout's gap; pw: the producer warp's empty barriers */
inline size_t k_gateup_tma_smem(uint32_t dim, int tr, int st, int ng = 0, int nw = 0,
                                bool spl = false, bool pw = false)
{
    return k_gu4_xbytes(dim) + (size_t)st * k_gut_stage(dim, tr) + (spl ? SL_GU_SPLIT_GAP : 0) +
           8 * (size_t)st * (pw ? 2 : 1) + 16 + (ng ? (size_t)ng * nw * 32 * 16 + 16 : 0);
}

/* ---- persistent pipelined down: bench run 7 (bench/results/2026-11-30-moe.md) ----
 *
 * k_down_tma_q3_k (bench/gpu/moe_sandbox.cuh) queues every byte of its CTA at once and
 * computes only when they have
 * landed, so the CTAs of a wave load together and then decode together (the copies
 * and the decode of one SM do not overlap), and its 640 CTAs are 1.2 waves. Here a CTA
 * walks tiles t = blockIdx.x, + grid, ... with ST stages of one tile each (every
 * expert's TD rows), so the next tiles' copies run while a tile is decoded, and tiles
 * of TD = 4 rows leave no wave tail worth a tile. NG groups of warps take the CTA's
 * tiles in turn (group G the k-th tiles with k = G mod NG), each with its own named
 * barrier. A tile of TD rows starts 8-byte aligned only, so each expert's slice is
 * copied as the 16-byte chunks covering it (within the 16-byte aligned tensor) into a
 * slot of k_dpt_cap bytes. The arithmetic and the combine are k_down_tma_q3_k's.
 * Measured (run 7), the persistent shapes lost inside the gate/up -> down chain; once
 * k_dot2_q3_k's decode took fewer instructions (session 6) ST 2 with 2 groups won, and
 * compute/moe.cu ships it with 4 lanes a row. */

/* Bytes of one expert's slot in a stage (the chunks covering TD rows, any 8-aligned
 * start). */
__host__ __device__ inline uint32_t k_dpt_cap(uint32_t inter, int td, int bb = 110)
{
    if (bb == SL_Q3K_PACKED) return (uint32_t)td * (inter / 256 * bb); /* 16-aligned tiles */
    return ((uint32_t)td * (inter / 256 * 110) + 15) / 16 * 16 + 16;
}
inline size_t k_dpt_smem(int n, uint32_t inter, int td, int st, int bb = 110)
{
    return (size_t)st * n * k_dpt_cap(inter, td, bb);
}
inline uint32_t k_dpt_threads(int n, int lpr, int td, int ng)
{
    return (uint32_t)(ng * n * td * lpr);
}

/* Four words at a 2-byte aligned shared address (5 aligned loads, 4 funnel shifts);
 * the aligned pointer is derived from p, so the loads stay shared-memory loads. */
__device__ __forceinline__ void k_ld4u(const uint8_t *p, uint32_t (&w)[4])
{
    const uint32_t mis = (uint32_t)(uintptr_t)p & 3;
    const uint32_t *q = (const uint32_t *)(p - mis);
    uint32_t t[5];
#pragma unroll
    for (int i = 0; i < 5; i++) t[i] = q[i];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = __funnelshift_r(t[i], t[i + 1], 8 * mis);
}

/* Lane (g, t)'s B words of half h of block b: the 16 activation codes of group g
 * where its column is its k group (g == t: b0, g == t + 4: b1), else zero. */
__device__ __forceinline__ void k_mma_b(const int8_t *__restrict__ aq, uint32_t b, int h, int g,
                                        int t, int4 &v0, int4 &v1)
{
    const int4 *ap = (const int4 *)(aq + 256 * b + 128 * h + 16 * g);
    const int4 z = make_int4(0, 0, 0, 0);
    v0 = g == t ? __ldg(ap) : z;
    v1 = g == t + 4 ? __ldg(ap) : z;
}

/* Q3_K on the tensor cores, k_mma4_q2_k's layout with two mma sets: the low bits (the
 * qs word masked in place, low * 4^s) and the missing high bit (the inverted hmask
 * word masked in place, (1 - hbit) * 2^(4h + s), at most 128). A code is
 * low - 4 * (1 - hbit), so a group's sum is (Clow >> 2s) - 4 * (Cneg >> (4h + s)).
 * One warp takes half h of every block of a 16-row tile (rows rb bytes apart, 2-byte
 * aligned, in shared memory), so that lane (g, t) keeps sl_emu_dot_q3_k's accumulator
 * 4h + t of rows g and g + 8: acc[row]. aq, ad: the activation's codes and scales in
 * global memory; the next block's codes load while a block is decoded. */
__device__ __forceinline__ void k_mma2_q3_k(const uint8_t *tile, uint32_t rb,
                                            const int8_t *__restrict__ aq,
                                            const float *__restrict__ ad, uint32_t nb, int h,
                                            float (&acc)[2])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, e = t & 1;
    const uint32_t mlo = 0x03030303u << (2 * (t >> 1)), mhi = mlo << 4;
    const uint32_t n0 = 0x01010101u << (4 * h + (t >> 1)), n2 = n0 << 2;
    const int hs = 4 * h + 2 * (t >> 1); /* the high scale bits' shift */
    const uint8_t *row0 = tile + (size_t)g * rb, *row1 = row0 + 8 * (size_t)rb;
    acc[0] = acc[1] = 0.0f;
    int4 v0, v1;
    k_mma_b(aq, 0, h, g, t, v0, v1);
    for (uint32_t b = 0; b < nb; b++) {
        const uint32_t b0[4] = {(uint32_t)v0.x, (uint32_t)v0.y, (uint32_t)v0.z, (uint32_t)v0.w};
        const uint32_t b1[4] = {(uint32_t)v1.x, (uint32_t)v1.y, (uint32_t)v1.z, (uint32_t)v1.w};
        if (b + 1 < nb) k_mma_b(aq, b + 1, h, g, t, v0, v1);
        const float d8 = __ldg(ad + 8 * b + 4 * h + t);
        const uint8_t *k[2] = {row0 + 110 * b, row1 + 110 * b};
        uint32_t hm[2][4], qw[2][4];
        int cl[4] = {0, 0, 0, 0}, cn[4] = {0, 0, 0, 0};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            k_ld4u(k[r] + 16 * e, hm[r]);
            k_ld4u(k[r] + 32 + 32 * h + 16 * e, qw[r]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            k_mma_u8s8(cl, qw[0][i] & mlo, qw[1][i] & mlo, qw[0][i] & mhi, qw[1][i] & mhi, b0[i],
                       b1[i]);
            k_mma_u8s8(cn, ~hm[0][i] & n0, ~hm[1][i] & n0, ~hm[0][i] & n2, ~hm[1][i] & n2, b0[i],
                       b1[i]);
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint32_t lo = *(const unsigned short *)(k[r] + 96 + 2 * t);
            const uint32_t hi = *(const unsigned short *)(k[r] + 104 + 2 * e);
            int isum = 0;
#pragma unroll
            for (int x = 0; x < 2; x++) { /* group 8h + 2t + x */
                const int c = (cl[2 * r + x] >> (2 * t)) - ((cn[2 * r + x] >> (4 * h + t)) << 2);
                const int sc =
                    (int)(((lo >> (8 * x + 4 * h)) & 15) | ((hi >> (8 * x + hs)) & 3) << 4) - 32;
                isum += sc * c;
            }
            acc[r] = sl_emu_q3_k_step(acc[r], k_half(k[r] + 108), isum, d8);
        }
    }
}

/* What lane sub = 2j + q of a Q3_K row (4 lanes a row) takes of every block: groups
 * g = 4j + q and g + 2. The fields in place (k_dp4a_us): group g's low bits at 2q,
 * g + 2's at 2q + 4 of every qs byte, their high bits at bits g and g + 2 of every
 * hmask byte; a code is low - 4 * (1 - hbit), so a group's sum is sum(low * a) -
 * 4 * sum(!hbit * a). The lane's four 6-bit scales (sub-blocks 2g, 2g + 1, 2g + 4,
 * 2g + 5): low nibbles j of bytes 2q, 2q + 1, 2q + 4, 2q + 5, high pairs at bits 4j
 * (4j + 2 for the last two) of bytes 8 + 2q, 8 + 2q + 1 of the 12 packed bytes. */
struct k_q3_sel {
    int j, q, g, ns;
    uint32_t mq0, mq1, mh0, mh1, sel_lo, sel_hi;
};

__device__ __forceinline__ k_q3_sel k_q3_sel_of(int sub)
{
    k_q3_sel s;
    s.j = sub >> 1;
    s.q = sub & 1;
    s.g = 4 * s.j + s.q;
    s.ns = 4 * s.j;
    s.mq0 = 0x03030303u << (2 * s.q);
    s.mq1 = s.mq0 << 4;
    s.mh0 = 0x01010101u << s.g;
    s.mh1 = s.mh0 << 2;
    s.sel_lo = s.q ? 0x7632u : 0x5410u;
    s.sel_hi = s.q ? 0x3232u : 0x1010u;
    return s;
}

/* One block of k_dot2_q3_k's lane (its masks and selectors: ls) at blk, the lane's
 * activation of it at aw (aq + 256 b + 32 g) and a8 (ad + 8 b + g), into acc; PART: its
 * two steps' operands instead, (d * isum, d8) of group i at part[32 * i] (another warp's
 * chain takes them: sl_emu_q3_k_step's bits). */
template <int BB, bool PART = false>
__device__ __forceinline__ void k_dot2_at(const uint8_t *blk, const int4 *__restrict__ aw,
                                          const float *__restrict__ a8, const k_q3_sel &ls,
                                          float (&acc)[2], float2 *part = nullptr)
{
    const int j = ls.j, q = ls.q, g = ls.g, ns = ls.ns;
    const uint32_t mq0 = ls.mq0, mq1 = ls.mq1, mh0 = ls.mh0, mh1 = ls.mh1;
    const uint32_t sel_lo = ls.sel_lo, sel_hi = ls.sel_hi;
    uint32_t hm[8], qw[8], sw[3];
    float d;
    if (BB == 110) {
        k_ld8(blk, hm);
        k_ld8(blk + 32 + 32 * j, qw);
        k_ld3(blk + 96, sw);
        d = k_half(blk + 108);
    } else { /* 16-byte aligned: seven vector loads' worth, no realignment */
        const uint4 *v = (const uint4 *)blk;
        k_ld16x2(v, hm);
        k_ld16x2(v + 2 + 2 * j, qw);
        const uint4 t = v[6];
        sw[0] = t.x;
        sw[1] = t.y;
        sw[2] = t.z;
        d = __half2float(__ushort_as_half((unsigned short)(t.w & 0xFFFFu)));
    }
    const uint32_t hb = __byte_perm(sw[2], 0u, sel_hi);
    const uint32_t sc = ((__byte_perm(sw[0], sw[1], sel_lo) >> ns) & 0x0F0F0F0Fu) |
                        (((hb >> ns) & 0x00000303u) | ((hb >> (ns + 2)) & 0x03030000u)) << 4;
    const int4 x0 = __ldg(aw), x1 = __ldg(aw + 1), y0 = __ldg(aw + 4), y1 = __ldg(aw + 5);
    const int av[2][8] = {{x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w},
                          {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w}};
    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0}; /* [2 * group + half] */
#pragma unroll
    for (int w = 0; w < 8; w++) {
        const int h = w >> 2;
        lo[h] = k_dp4a_us(qw[w] & mq0, av[0][w], lo[h]);
        hi[h] = k_dp4a_us(~hm[w] & mh0, av[0][w], hi[h]);
        lo[2 + h] = k_dp4a_us(qw[w] & mq1, av[1][w], lo[2 + h]);
        hi[2 + h] = k_dp4a_us(~hm[w] & mh1, av[1][w], hi[2 + h]);
    }
    int c[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int i = k >> 1;
        c[k] = (lo[k] >> (2 * q + 4 * i)) - 4 * (hi[k] >> (g + 2 * i));
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int s0 = (int)((sc >> (16 * i)) & 63u) - 32;
        const int s1 = (int)((sc >> (16 * i + 8)) & 63u) - 32;
        const int isum = s0 * c[2 * i] + s1 * c[2 * i + 1];
        const float d8 = __ldg(a8 + 2 * i);
        if (PART)
            part[32 * i] = make_float2(sl_emu_mul(d, (float)isum), d8);
        else
            acc[i] = sl_emu_q3_k_step(acc[i], d, isum, d8);
    }
}

/* Block b of a row (k_dot2_at with its pointers built from b). */
template <int BB, bool PART = false>
__device__ __forceinline__ void
k_dot2_block(const uint8_t *row, const int8_t *__restrict__ aq, const float *__restrict__ ad,
             uint32_t b, const k_q3_sel &ls, float (&acc)[2], float2 *part = nullptr)
{
    k_dot2_at<BB, PART>(row + BB * b, (const int4 *)(aq + 256 * b + 32 * ls.g), ad + 8 * b + ls.g,
                        ls, acc, part);
}

/* The two accumulators (k_q3_sel's groups of every block, in increasing b) of lane
 * sub of one Q3_K row (4 lanes a row; row 2-byte aligned in shared
 * memory; the activation read through L1). The two groups share their qs, hmask and
 * scale words (shifts 2q and 2q + 4), which halves the shared-memory loads and
 * realignments of k_dot_q3_k per weight. UNR 2: two blocks' chains interleave (a lone
 * tile's latency; acc still takes them in increasing b). */
template <int BB = 110, int UNR = 1, bool PART = false>
__device__ __forceinline__ void
k_dot2_q3_k(const uint8_t *row, const int8_t *__restrict__ aq, const float *__restrict__ ad,
            uint32_t nb, int sub, float (&acc)[2], uint32_t b0 = 0, float2 *part = nullptr)
{
    static_assert(BB == 110 || BB == SL_Q3K_PACKED, "a raw or a packed Q3_K block");
    const k_q3_sel ls = k_q3_sel_of(sub);
    acc[0] = 0.0f;
    acc[1] = 0.0f;
    if (PART) { /* blocks b0 .. nb - 1: their steps' operands, 64 float2 apart a block */
        for (uint32_t b = b0; b < nb; b++)
            k_dot2_block<BB, true>(row, aq, ad, b, ls, acc, part + 64 * (b - b0));
    } else { /* the pointers advanced, not rebuilt from b (fewer instructions a block) */
        const uint8_t *blk = row;
        const int4 *aw = (const int4 *)(aq + 32 * ls.g);
        const float *a8 = ad + ls.g;
        if (UNR > 1) {
#pragma unroll UNR
            for (uint32_t b = 0; b < nb; b++, blk += BB, aw += 16, a8 += 8)
                k_dot2_at<BB>(blk, aw, a8, ls, acc);
        } else { /* the compiler's own unrolling */
            for (uint32_t b = 0; b < nb; b++, blk += BB, aw += 16, a8 += 8)
                k_dot2_at<BB>(blk, aw, a8, ls, acc);
        }
    }
}

/* Lane 8p + g of a warp over one 8-row tile in the tiled layout (SL_Q3K_TB, moe_emu.h;
 * tile 16-byte aligned in shared memory): group g of rows 2p and 2p + 1 of every block,
 * in increasing b, into acc[0] and acc[1] (sl_emu_dot_q3_k_tb's lanes). The group's
 * activation (32 codes, one scale) serves both rows; each row's low fields sit at shift
 * 4 (p & 1) + 2 (row & 1) of the quad's words, its high bits at bit 2p + (row & 1) of
 * the 8 rows' words. UNR: blocks whose chains the compiler interleaves. */
template <int UNR = 1>
__device__ __forceinline__ void k_dot_tb_q3_k(const uint8_t *tile, const int8_t *__restrict__ aq,
                                              const float *__restrict__ ad, uint32_t nb, int lane,
                                              float (&acc)[2])
{
    const int p = lane >> 3, g = lane & 7, lsh = 4 * (p & 1), hsh = 2 * p;
    const uint32_t ma = 0x03030303u << lsh, mb = ma << 2, na = 0x01010101u << hsh, nb1 = na << 1;
    /* the lane's words of block b at these + b * SL_Q3K_TB (pointers advanced a block at a
     * time: fewer instructions than offsets rebuilt from b) */
    const uint8_t *lo = tile + 256 * (p >> 1) + 16 * g, *hi = tile + 512 + 16 * g;
    const uint8_t *sc = tile + 768 + 2 * lane, *sh = tile + 832 + lane, *dp = tile + 864 + 4 * p;
    const int4 *aw = (const int4 *)(aq + 32 * g);
    const float *a8 = ad + g;
    acc[0] = 0.0f;
    acc[1] = 0.0f;
#pragma unroll UNR
    for (uint32_t b = 0; b < nb; b++, lo += SL_Q3K_TB, hi += SL_Q3K_TB, sc += SL_Q3K_TB,
                  sh += SL_Q3K_TB, dp += SL_Q3K_TB, aw += 16, a8 += 8) {
        const uint4 l0 = *(const uint4 *)lo, l1 = *(const uint4 *)(lo + 128);
        const uint4 h0 = *(const uint4 *)hi, h1 = *(const uint4 *)(hi + 128);
        const int4 x0 = __ldg(aw), x1 = __ldg(aw + 1);
        const uint32_t z = *(const unsigned short *)sc | (uint32_t)*sh << 16;
        const uint32_t dw = *(const uint32_t *)dp;
        const float d8 = __ldg(a8);
        const uint32_t lw[2][4] = {{l0.x, l0.y, l0.z, l0.w}, {l1.x, l1.y, l1.z, l1.w}};
        const uint32_t hw[2][4] = {{h0.x, h0.y, h0.z, h0.w}, {h1.x, h1.y, h1.z, h1.w}};
        const int av[2][4] = {{x0.x, x0.y, x0.z, x0.w}, {x1.x, x1.y, x1.z, x1.w}};
        int ca[2], cb[2];
#pragma unroll
        for (int v = 0; v < 2; v++) {
            int la = 0, lb = 0, ha = 0, hb = 0;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                la = k_dp4a_us(lw[v][u] & ma, av[v][u], la);
                lb = k_dp4a_us(lw[v][u] & mb, av[v][u], lb);
                ha = k_dp4a_us(~hw[v][u] & na, av[v][u], ha);
                hb = k_dp4a_us(~hw[v][u] & nb1, av[v][u], hb);
            }
            ca[v] = (la >> lsh) - 4 * (ha >> hsh);
            cb[v] = (lb >> (lsh + 2)) - 4 * (hb >> (hsh + 1));
        }
        const int ia = ((int)(z & 63u) - 32) * ca[0] + ((int)((z >> 6) & 63u) - 32) * ca[1];
        const int ib = ((int)((z >> 12) & 63u) - 32) * cb[0] + ((int)(z >> 18) - 32) * cb[1];
        const float da = __half2float(__ushort_as_half((unsigned short)(dw & 0xFFFFu)));
        const float db = __half2float(__ushort_as_half((unsigned short)(dw >> 16)));
        acc[0] = sl_emu_q3_k_step(acc[0], da, ia, d8);
        acc[1] = sl_emu_q3_k_step(acc[1], db, ib, d8);
    }
}

/* The 8-lane butterfly of sl_emu_dot_q3_k over the 4 lanes of a row (sub = 2j + q)
 * holding groups 4j + q and 4j + q + 2: its xor 4 flips j (xor 2 here), its xor 2 is
 * the sum inside the lane, its xor 1 flips q. All 4 lanes end with the sum. */
__device__ __forceinline__ float k_comb22(float (&a)[2])
{
    a[0] = sl_emu_add(a[0], __shfl_xor_sync(~0u, a[0], 2));
    a[1] = sl_emu_add(a[1], __shfl_xor_sync(~0u, a[1], 2));
    const float t = sl_emu_add(a[0], a[1]);
    return sl_emu_add(t, __shfl_xor_sync(~0u, t, 1));
}

/* Output row o of a down: the experts' bf16-rounded rows y[x * stride] (table order,
 * increasing expert id) summed, + extra, into out_f32 and/or out_bf16; with part, each
 * expert's row written apart at its slot instead (k_combine sums them). */
__device__ __forceinline__ void
k_down_store(const sl_ktab &tab, uint32_t o, uint32_t dim, const float *y, int stride,
             const float *__restrict__ extra, float *__restrict__ out_f32,
             uint16_t *__restrict__ out_bf16, float *__restrict__ part)
{
    if (part) {
        for (int x = 0; x < tab.n; x++) part[(size_t)tab.e[x].slot * dim + o] = y[x * stride];
        return;
    }
    float v = 0.0f;
    for (int x = 0; x < tab.n; x++) v = sl_emu_add(v, y[x * stride]);
    if (extra) v = sl_emu_add(v, extra[o]);
    if (out_f32) out_f32[o] = v;
    if (out_bf16) out_bf16[o] = sl_emu_bf16_bits(v);
}

/* Down (Q3_K) of every expert of the table and their sum, persistent over tiles of TD
 * output rows (see the section comment); LPR lanes a row (8: k_dot_q3_k, 4:
 * k_dot2_q3_k), a group of n*TD*LPR threads (warp-aligned: TD*LPR % 32 == 0), the
 * bf16-rounded outputs meet in shared memory and TD threads of the group add them in
 * table order (increasing expert id), then `extra`. blockDim = NG*n*TD*LPR. */
template <int LPR, int TD, int ST, int NG, bool MMA, bool EI, bool STAMP, int BB = 110, int UNR = 1,
          bool SPLIT = false, bool TB = false>
__device__ __forceinline__ void
k_down_pt_body(const sl_ktab &tab, const int8_t *__restrict__ hq, const float *__restrict__ hd,
               uint32_t dim, uint32_t inter, const float *__restrict__ extra,
               float *__restrict__ out_f32, uint16_t *__restrict__ out_bf16,
               float *__restrict__ part, unsigned long long *stamps)
{
    static_assert(ST % NG == 0, "a stage always serves the same group");
    static_assert(TD * LPR % 32 == 0, "an expert's rows fill whole warps");
    static_assert(!MMA || (TD == 16 && LPR == 4 && NG == 1),
                  "mma: two warps (halves h) an expert's 16 rows");
    static_assert(!EI || (!MMA && TD * LPR == 32), "early refill: a warp an expert's rows");
    static_assert(BB == 110 || (BB == SL_Q3K_PACKED && !MMA && LPR == 4),
                  "packed blocks: the dp4a form of 4 lanes a row");
    static_assert(!SPLIT || (EI && LPR == 4 && ST == 2 && NG == 2),
                  "a shared last tile: two groups, a stage each, a warp an expert");
    static_assert(!TB || (EI && !SPLIT && TD == 8 && BB == SL_Q3K_PACKED),
                  "the tiled layout: a warp an expert's 8 rows, tiles as long as packed ones");
    __shared__ float2 red[MMA ? SL_GPU_MAX_USED : 1][32]; /* mma: the h = 1 warps' sums */
    extern __shared__ int4 k_smem[];
    __shared__ float ys[NG][2][SL_GPU_MAX_USED][TD];
    __shared__ uint64_t bar[ST][SL_GPU_MAX_USED]; /* one an expert: its warps start as it lands */
    __shared__ volatile uint32_t seen[SPLIT ? SL_GPU_MAX_USED : 1]; /* group 0's tile k landed */
    const uint32_t rb = inter / 256 * BB, nb = inter / 256, cap = k_dpt_cap(inter, TD, BB);
    const uint32_t tiles = dim / TD, grid = gridDim.x;
    const int n = tab.n, gsz = n * TD * LPR;
    const int grp = threadIdx.x / gsz, in = threadIdx.x % gsz;
    const int e = in / (TD * LPR), r = in % (TD * LPR) / LPR, sub = in % LPR;
    uint8_t *stage = (uint8_t *)k_smem;

    /* the CTA's k-th tile of expert x into stage k % ST */
    auto issue_one = [&](uint32_t k, int x) {
        const uint32_t t = blockIdx.x + k * grid;
        if (t >= tiles) return;
        const size_t at = (size_t)t * TD * rb;
        const uint32_t off = (uint32_t)(at & 15);
        const uint32_t bytes = (off + TD * rb + 15) / 16 * 16;
        uint64_t *b = &bar[k % ST][x];
        k_mbar_expect(b, bytes);
        k_bulk_w<(SL_BULK_EF & 2) != 0>(stage + ((size_t)(k % ST) * n + x) * cap,
                                        tab.e[x].down + at - off, bytes, b);
    };
    auto issue = [&](uint32_t k) {
        for (int x = 0; x < n; x++) issue_one(k, x);
    };
    unsigned long long *rec = STAMP ? k_stamp_rec(stamps, NG, grp, in == 0) : nullptr;
    k_stamp(rec, 0);
    k_pipe_start<ST>(&bar[0][0], ST * SL_GPU_MAX_USED, [&](uint32_t k) {
        issue(k);
        return true;
    });
    if (SPLIT && threadIdx.x < SL_GPU_MAX_USED) seen[threadIdx.x] = ~0u;
    k_stamp(rec, 1);
    __syncthreads();                          /* the barriers are initialised */
    const int hs = e < n ? tab.e[e].slot : 0; /* the expert's row of h */
    const int8_t *aq = hq + (size_t)hs * inter;
    const float *adp = hd + (size_t)hs * (inter / 32);
    /* SPLIT: when the CTA has an odd count of tiles, group 0's last one would run alone
     * (the down's longest stretch: one tile's chains of nb blocks on an idle SM), so
     * group 1 takes its blocks nb / 2 ..: their steps' operands (k_dot2_block's PART) go
     * to group 1's stage, free by then (its last refill asked for tile kt, which does not
     * exist), and group 0 runs blocks 0 .. nb / 2 - 1 and then those steps, in order
     * (the same bits). Group 0 tells its warps' last tile landed through seen[] (group 1
     * never waited on group 0's stage, so the mbarrier's parity alone could match a
     * phase two tiles old), group 1 that the operands are written by named barrier 3. */
    const uint32_t kt = blockIdx.x < tiles ? (tiles - blockIdx.x + grid - 1) / grid : 0;
    const uint32_t kl = SPLIT && (kt & 1) ? kt - 1 : ~0u; /* the shared tile, if any */
    /* warp e's operands in stage 1: [block - nb / 2][group of the lane][lane] */
    float2 *const pscr =
        (float2 *)(stage + (size_t)n * cap) + (size_t)(in >> 5) * 64 * (nb - nb / 2) + (in & 31);
    uint32_t i = 0; /* the group's tiles done */
    for (uint32_t k = grp; blockIdx.x + k * grid < tiles; k += NG, i++) {
        const uint32_t t = blockIdx.x + k * grid;
        const uint32_t off = (uint32_t)(((size_t)t * TD * rb) & 15);
        k_mbar_wait(&bar[k % ST][e], (k / ST) & 1);
        if (SPLIT && grp == 0 && (in & 31) == 0) seen[e] = k; /* for group 1 (SPLIT) */
        k_stamp_unit(rec, i, 0);
        const uint8_t *row = stage + (size_t)(k % ST) * n * cap + (size_t)e * cap + off + r * rb;
        float(*y)[TD] = ys[grp][(k / NG) & 1]; /* rewritten 2 tiles later, after a barrier */
        if (MMA) { /* warps 2e + h: the expert's 16 rows, half h of every block */
            const int hh = (in >> 5) & 1, ln = in & 31;
            float acc[2];
            k_mma2_q3_k(row - r * rb, rb, aq, adp, nb, hh, acc);
            if (hh) red[e][ln] = make_float2(acc[0], acc[1]);
            __syncthreads();
            if (!hh) { /* sl_emu_dot_q3_k's butterfly: xor 4 is h, xor 2 and 1 are t's bits */
                float v[2] = {sl_emu_add(acc[0], red[e][ln].x), sl_emu_add(acc[1], red[e][ln].y)};
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    v[q] = sl_emu_add(v[q], __shfl_xor_sync(~0u, v[q], 2));
                    v[q] = sl_emu_add(v[q], __shfl_xor_sync(~0u, v[q], 1));
                }
                if ((ln & 3) == 0) { /* lane 4g: rows g and g + 8 */
                    y[e][ln >> 2] = sl_emu_bf16_round(v[0]);
                    y[e][(ln >> 2) + 8] = sl_emu_bf16_round(v[1]);
                }
            }
        } else if (TB) { /* lane 8p + g: group g of rows 2p, 2p + 1 */
            float acc[2];
            k_dot_tb_q3_k<UNR>(row - r * rb, aq, adp, nb, in & 31, acc);
            const float a0 = k_butterfly(acc[0], 4), a1 = k_butterfly(acc[1], 4);
            __syncwarp();
            if ((in & 31) == 0) {
                k_fence_proxy();
                issue_one(k + ST, e);
            }
            if ((in & 7) == 0) {
                y[e][(in & 31) >> 2] = sl_emu_bf16_round(a0);
                y[e][((in & 31) >> 2) + 1] = sl_emu_bf16_round(a1);
            }
        } else {
            float a;
            if (LPR == 8) {
                a = k_butterfly(k_dot_q3_k(row, aq, adp, nb, sub), 4);
            } else {
                float acc[2];
                if (SPLIT && k == kl) {
                    k_dot2_q3_k<BB, UNR>(row, aq, adp, nb / 2, sub, acc);
                    asm volatile("bar.sync 3, %0;\n" ::"r"(2 * gsz) : "memory");
                    for (uint32_t b = 0; b < nb - nb / 2; b++)
#pragma unroll
                        for (int q = 0; q < 2; q++) {
                            const float2 o = pscr[64 * b + 32 * q];
                            acc[q] = sl_emu_fma(o.y, o.x, acc[q]); /* sl_emu_q3_k_step */
                        }
                } else
                    k_dot2_q3_k<BB, UNR>(row, aq, adp, nb, sub, acc);
                a = k_comb22(acc);
            }
            if (EI) { /* the expert's slot is its warp's alone: refill it before the
                       * group's barrier (the shuffles above consumed every lane's loads) */
                __syncwarp();
                if ((in & 31) == 0) {
                    k_fence_proxy();
                    issue_one(k + ST, e);
                }
            }
            if (sub == 0) y[e][r] = sl_emu_bf16_round(a);
        }
        if (NG == 1)
            __syncthreads();
        else /* the group's own barrier (id 0 is __syncthreads') */
            asm volatile("bar.sync %0, %1;\n" ::"r"(1 + grp), "r"(gsz) : "memory");
        if (!EI && in == 0) {
            k_fence_proxy();
            issue(k + ST);
        }
        if (in < TD)
            k_down_store(tab, t * TD + in, dim, &y[0][in], TD, extra, out_f32, out_bf16, part);
        k_stamp_unit(rec, i, 1);
    }
    if (SPLIT && kl != ~0u && grp == 1) { /* group 0's last tile, blocks nb / 2 .. nb - 1 */
        const uint32_t k = kl, t = blockIdx.x + k * grid;
        const uint32_t off = (uint32_t)(((size_t)t * TD * rb) & 15);
        while (seen[e] != k) { /* group 0's warp e saw the tile land, so this parity */
        }                      /* can only mean its phase */
        k_mbar_wait(&bar[k % ST][e], (k / ST) & 1);
        const uint8_t *row = stage + (size_t)(k % ST) * n * cap + (size_t)e * cap + off + r * rb;
        float acc[2];
        k_dot2_q3_k<BB, UNR, true>(row, aq, adp, nb, sub, acc, nb / 2, pscr);
        asm volatile("bar.arrive 3, %0;\n" ::"r"(2 * gsz) : "memory");
    }
    k_stamp_end(rec, i);
}

/* EI (whenever an expert's rows are one warp): each expert's warp refills its slot of the
 * stage as soon as it is done with it; else thread 0 refills the stage after the group's
 * barrier (bench/results/2026-12-01-s8-stalls.md). */
template <int LPR, int TD, int ST, int NG, bool EI = TD *LPR == 32, bool STAMP = false,
          int BB = 110, int UNR = 1, bool SPLIT = false, bool TB = false>
__global__ void __launch_bounds__(NG *SL_GPU_MAX_USED *TD *LPR, 2)
    k_down_pt_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                   const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                   const float *__restrict__ extra, float *__restrict__ out_f32,
                   uint16_t *__restrict__ out_bf16, float *__restrict__ part,
                   unsigned long long *stamps)
{
    k_down_pt_body<LPR, TD, ST, NG, false, EI, STAMP, BB, UNR, SPLIT, TB>(
        tab, hq, hd, dim, inter, extra, out_f32, out_bf16, part, stamps);
}

/* The combine of k_down_pt_q3_k for experts whose rows were written apart (part):
 * y = 0 + part[0][o] + ... + part[n-1][o] (slot order, i.e. increasing expert id, then
 * the shared expert), + extra, as the fused combine adds them. */
__global__ void k_combine(const float *__restrict__ part, uint32_t n, uint32_t dim,
                          const float *__restrict__ extra, float *__restrict__ out_f32,
                          uint16_t *__restrict__ out_bf16)
{
    k_pdl_wait();
    k_pdl_go();
    const uint32_t o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= dim) return;
    float v = 0.0f;
    for (uint32_t x = 0; x < n; x++) v = sl_emu_add(v, part[(size_t)x * dim + o]);
    if (extra) v = sl_emu_add(v, extra[o]);
    if (out_f32) out_f32[o] = v;
    if (out_bf16) out_bf16[o] = sl_emu_bf16_bits(v);
}

/* q8_1 of h as k_quant_h, for launches with programmatic dependent launch, of the
 * experts whose slot bit is set in mask (gpe groups of 32 an expert; ~0u: all). It lets
 * the next kernel (the down projection) launch before it waits: that one's CTAs take
 * the SMs the gate/up's CTAs leave (its tail), queue their weights there, and wait
 * (k_pdl_wait) before reading h. */
__global__ void k_quant_h_pdl(const __grid_constant__ sl_kscratch s, uint32_t groups, uint32_t gpe,
                              uint32_t mask)
{
    k_pdl_go();
    k_pdl_wait();
    const int lane = threadIdx.x & 31;
    const uint32_t grp = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (grp >= groups || !(mask >> (grp / gpe) & 1)) return;
    k_quant_h_group(s, grp, s.h[(size_t)grp * 32 + lane], lane);
}

/* q8_1 of the SwiGLU outputs h [groups*32] (one warp per block of 32), for gate/up
 * launches without the fused quantization. */
__global__ void k_quant_h(const __grid_constant__ sl_kscratch s, uint32_t groups)
{
    const int lane = threadIdx.x & 31;
    const uint32_t grp = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (grp >= groups) return;
    k_quant_h_group(s, grp, s.h[(size_t)grp * 32 + lane], lane);
}

/* Down (Q3_K), one CTA per T 4-row tiles with one warp per expert of the table
 * (blockDim = 32 * n): each warp stages its expert's 4 rows (the next tile's load in
 * flight while it computes) and computes them (8 lanes a row);
 * the bf16-rounded outputs meet in shared memory and 4 threads add them in table
 * order (increasing expert id), then `extra`. Same arithmetic as the sandbox's
 * k_down_q3_k. Each warp reads its expert's down raw (staged) or tiled (tab.pk: in
 * place, k_dot_q3_k_tbrow), so one launch takes the device tier's tiled downs beside
 * mapped host memory's raw ones. */
template <int MAXV, int T>
__global__ void __launch_bounds__(SL_GPU_MAX_USED * 32)
    k_down2_q3_k(const __grid_constant__ sl_ktab tab, const int8_t *__restrict__ hq,
                 const float *__restrict__ hd, uint32_t dim, uint32_t inter,
                 const float *__restrict__ extra, float *__restrict__ out_f32,
                 uint16_t *__restrict__ out_bf16)
{
    extern __shared__ int4 k_smem[];
    __shared__ float ys[T][SL_GPU_MAX_USED][4];
    const int lane = threadIdx.x & 31, e = threadIdx.x >> 5, team = lane >> 3, g = lane & 7;
    int4 *st = k_smem + (size_t)e * (MAXV * 32 + 1);
    const bool tiled = tab.pk >> e & 1; /* the warp's expert's down: tiled or raw blocks */
    const uint32_t rb = inter / 256 * 110, nb = inter / 256;
    const uint32_t tiles = dim / 4, u0 = blockIdx.x * T;
    const int8_t *aq = hq + (size_t)e * inter;
    const float *ad = hd + (size_t)e * (inter / 32);
    if (tiled) { /* device memory: read in place, rows 4u + team of the 8-row tiles */
        for (int t = 0; t < T; t++) {
            if (u0 + t >= tiles) break; /* uniform across the CTA */
            const uint32_t row = 4 * (u0 + t) + (uint32_t)team;
            const uint8_t *tile = tab.e[e].down + (size_t)(row / 8) * nb * SL_Q3K_TB;
            const float a = k_butterfly(k_dot_q3_k_tbrow(tile, row % 8, aq, ad, nb, g), 4);
            if (g == 0) ys[t][e][team] = sl_emu_bf16_round(a);
        }
    } else { /* raw blocks: staged through shared memory a 4-row tile at a time */
        const uint8_t *src = tab.e[e].down + (size_t)u0 * 4 * rb;
        const int4 *p;
        int cnt = k_span(src, 4 * rb, &p);
        int4 v[MAXV];
        k_span_load<MAXV>(v, p, cnt, lane);
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (u0 + t >= tiles) break; /* uniform across the CTA */
            const uint32_t off = (uint32_t)((uintptr_t)src & 15);
            __syncwarp();
            k_span_store<MAXV>(v, st, cnt, lane);
            __syncwarp();
            if (t + 1 < T && u0 + t + 1 < tiles) { /* prefetch the next tile */
                src += 4 * rb;
                cnt = k_span(src, 4 * rb, &p);
                k_span_load<MAXV>(v, p, cnt, lane);
            }
            float a = k_dot_q3_k((const uint8_t *)st + off + team * rb, aq, ad, nb, g);
            a = k_butterfly(a, 4);
            if (g == 0) ys[t][e][team] = sl_emu_bf16_round(a);
        }
    }
    __syncthreads();
    if (threadIdx.x < 4 * T) {
        const int t = threadIdx.x >> 2, i = threadIdx.x & 3;
        if (u0 + t >= tiles) return;
        const uint32_t r = 4 * (u0 + t) + i;
        float y = 0.0f;
        for (int k = 0; k < tab.n; k++) y = sl_emu_add(y, ys[t][k][i]);
        if (extra) y = sl_emu_add(y, extra[r]);
        if (out_f32) out_f32[r] = y;
        if (out_bf16) out_bf16[r] = sl_emu_bf16_bits(y);
    }
}

/* BF16 gate/up of one expert (the shared expert's BF16 variant): one row pair per
 * warp step, x widened to f32 in shared memory, SwiGLU into s.h (no quantization). */
template <int NW>
__global__ void __launch_bounds__(NW * 32)
    k_gateup_bf16(const __grid_constant__ sl_ktab tab, const uint16_t *__restrict__ x, uint32_t dim,
                  uint32_t inter, float limit, const __grid_constant__ sl_kscratch s)
{
    extern __shared__ int4 k_smem[];
    float *xf = (float *)k_smem;
    for (uint32_t i = threadIdx.x; i < dim; i += NW * 32) xf[i] = sl_emu_bf16_to_f32(x[i]);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t units = (uint32_t)tab.n * inter;
    for (uint32_t u = blockIdx.x * NW + warp; u < units; u += gridDim.x * NW) {
        const uint32_t e = u / inter, r = u % inter;
        float g = k_dot_bf16((const uint16_t *)tab.e[e].gate + (size_t)r * dim, xf, dim, lane);
        float v = k_dot_bf16((const uint16_t *)tab.e[e].up + (size_t)r * dim, xf, dim, lane);
        g = k_butterfly(g, 16);
        v = k_butterfly(v, 16);
        k_swiglu_out(g, v, tab.e[e].w, limit, (uint32_t)tab.e[e].slot, r, inter, s, false, lane);
    }
}

/* BF16 down of one expert: one row per warp, h (f32) staged in shared memory; writes
 * the bf16-rounded row outputs as f32. */
template <int NW>
__global__ void __launch_bounds__(NW * 32)
    k_down_bf16(const uint16_t *__restrict__ w, const float *__restrict__ h, uint32_t dim,
                uint32_t inter, float *__restrict__ out_f32)
{
    extern __shared__ int4 k_smem[];
    float *hf = (float *)k_smem;
    for (uint32_t i = threadIdx.x; i < inter; i += NW * 32) hf[i] = h[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t r = blockIdx.x * NW + warp; r < dim; r += gridDim.x * NW) {
        const float a = k_butterfly(k_dot_bf16(w + (size_t)r * inter, hf, inter, lane), 16);
        if (lane == 0) out_f32[r] = sl_emu_bf16_round(a);
    }
}

/* Router logits: one warp per expert, x widened in shared memory, the 32-lane order
 * of sl_router_logits; divided by temp when temp != 1. */
template <int NW>
__global__ void __launch_bounds__(NW * 32)
    k_router(const uint16_t *__restrict__ w, const uint16_t *__restrict__ x, uint32_t n_expert,
             uint32_t dim, float temp, float *__restrict__ logits)
{
    extern __shared__ int4 k_smem[];
    float *xf = (float *)k_smem;
    for (uint32_t i = threadIdx.x; i < dim; i += NW * 32) xf[i] = sl_emu_bf16_to_f32(x[i]);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t e = blockIdx.x * NW + warp; e < n_expert; e += gridDim.x * NW) {
        float a = k_butterfly(k_dot_bf16(w + (size_t)e * dim, xf, dim, lane), 16);
        if (temp != 1.0f) a = sl_emu_div(a, temp);
        if (lane == 0) logits[e] = a;
    }
}

/* The previous layer's residual and this layer's ffn_norm folded into the router
 * (k_router_pf's NORM form): h, y (NULL: no residual) and w are read, h_out (never h:
 * every CTA reads h) gets bf16(h + y) and x the normed input, each CTA writing its rows
 * of 256 values of both. */
struct k_rnorm {
    const uint16_t *h, *y;
    uint16_t *h_out, *x;
    const float *w;
    float eps;
};

/* Where value i of x sits in the router's f32 copy in shared memory: the 8 values of
 * each chunk (a lane's, k_router_pf) as two 4-value halves kept dim / 2 floats apart,
 * so that the 16-byte loads of 8 lanes in a row are 128 consecutive bytes (no bank
 * conflict; 32 bytes a lane were two ways). */
__device__ __forceinline__ uint32_t k_xf_at(uint32_t i, uint32_t dim)
{
    return (i & 4) * (dim / 8) + (i >> 3) * 4 + (i & 3);
}

constexpr int K_NORM_E = 24; /* k_norm_in_cta's rows of 256 values: dim <= 6144 */

/* Thread t's norm weights of k_norm_in_cta, loaded before the wait for the kernel
 * before (weights: only h and y are read after it); E rows of room. */
template <int E>
__device__ __forceinline__ void k_norm_w(const k_rnorm &nm, uint32_t dim, float2 (&wv)[E])
{
#pragma unroll
    for (int q = 0; q < E; q++)
        if ((uint32_t)q < dim / SL_EMU_NORM_LANES)
            wv[q] = ((const float2 *)nm.w)[threadIdx.x + SL_EMU_NORM_LANES / 2 * q];
}

/* sl_emu_residual_norm (w not NULL) in one CTA of 128 threads, into xf (f32, shared,
 * at k_xf_at) and, for its rows, into nm.h_out and nm.x: thread t holds the emulation's
 * lanes 2t and 2t + 1 (a bf16 pair a load; h and y loaded at once, w before, k_norm_w),
 * adds their squares in increasing i, the 256 lanes' sums meet in the emulation's
 * pairing (s[t] + s[t + off] for off = 128, 64, ..., 1): the first three rounds by warp
 * 0 from ss, the rest by its shuffles, so two barriers instead of nine. */
template <int E>
__device__ __forceinline__ void k_norm_in_cta(const k_rnorm &nm, uint32_t dim, float *ss, float *xf,
                                              const float2 (&wv)[E], unsigned long long *rec)
{
    constexpr uint32_t NT = SL_EMU_NORM_LANES / 2;
    const uint32_t t = threadIdx.x, ne = dim / SL_EMU_NORM_LANES;
    const uint32_t *h2 = (const uint32_t *)nm.h, *y2 = (const uint32_t *)nm.y;
    /* bit q: row q is this CTA's to write (q % gridDim.x == blockIdx.x), found once:
     * a remainder by gridDim.x in each unrolled row cost ~1 us of the norm (session 23) */
    static_assert(E <= 32, "a bit a row");
    uint32_t mine = 0;
    for (uint32_t q = blockIdx.x; q < (uint32_t)E; q += gridDim.x) mine |= 1u << q;
    uint32_t hv[E], yv[E];
#pragma unroll
    for (int q = 0; q < E; q++)
        if ((uint32_t)q < ne) {
            hv[q] = h2[t + NT * q];
            if (y2) yv[q] = y2[t + NT * q];
        }
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int q = 0; q < E; q++) {
        if ((uint32_t)q >= ne) break;
        if (y2) {
            const uint32_t lo =
                sl_emu_bf16_bits(sl_emu_add(sl_emu_float(hv[q] << 16), sl_emu_float(yv[q] << 16)));
            const uint32_t hi = sl_emu_bf16_bits(
                sl_emu_add(sl_emu_float(hv[q] & 0xffff0000u), sl_emu_float(yv[q] & 0xffff0000u)));
            hv[q] = lo | hi << 16;
            if (mine >> q & 1) ((uint32_t *)nm.h_out)[t + NT * q] = hv[q];
        }
        const float v0 = sl_emu_float(hv[q] << 16), v1 = sl_emu_float(hv[q] & 0xffff0000u);
        a0 = sl_emu_add(a0, sl_emu_mul(v0, v0));
        a1 = sl_emu_add(a1, sl_emu_mul(v1, v1));
    }
    static_assert(SL_EMU_NORM_LANES == 256, "three rounds from ss, five in a warp");
    k_stamp(rec, 4);
    ss[2 * t] = a0;
    ss[2 * t + 1] = a1;
    __syncthreads();
    if (t < 32) {
        float s1[4]; /* round 128 at t, t + 32, t + 64, t + 96 */
#pragma unroll
        for (int k = 0; k < 4; k++) s1[k] = sl_emu_add(ss[t + 32 * k], ss[t + 32 * k + 128]);
        float v = sl_emu_add(sl_emu_add(s1[0], s1[2]), sl_emu_add(s1[1], s1[3])); /* 64, 32 */
        for (int off = 16; off; off >>= 1) v = sl_emu_add(v, __shfl_down_sync(~0u, v, off));
        __syncwarp();
        if (t == 0)
            ss[0] = sl_emu_div(1.0f, sl_emu_sqrt(sl_emu_add(sl_emu_div(v, (float)dim), nm.eps)));
    }
    __syncthreads();
    k_stamp(rec, 5);
    const float r = ss[0];
#pragma unroll
    for (int q = 0; q < E; q++) {
        if ((uint32_t)q >= ne) break;
        const uint32_t i = 2 * t + SL_EMU_NORM_LANES * q;
        const uint32_t x0 =
            sl_emu_bf16_bits(sl_emu_mul(wv[q].x, sl_emu_mul(sl_emu_float(hv[q] << 16), r)));
        const uint32_t x1 =
            sl_emu_bf16_bits(sl_emu_mul(wv[q].y, sl_emu_mul(sl_emu_float(hv[q] & 0xffff0000u), r)));
        *(float2 *)(xf + k_xf_at(i, dim)) =
            make_float2(sl_emu_float(x0 << 16), sl_emu_float(x1 << 16));
        if (mine >> q & 1) ((uint32_t *)nm.x)[t + NT * q] = x0 | x1 << 16;
    }
}

/* Router logits as k_router (the same lanes and order), one warp per expert, each
 * lane holding its whole row share in registers (C 16-byte chunks, dim <= 256 C):
 * the weight loads are issued before the wait for the previous kernel (PDL), so they
 * overlap the norm that produces x. With ximg, the grid also quantizes x for the
 * bulk-copy gate/up (k_quant_x_img's bytes). NORM: x is not read but computed in each
 * CTA from nm (k_norm_in_cta), so the router waits for the down itself, not for a
 * norm kernel after it. EXACT: dim is 256 C (the launch picks it for the model's
 * shape), so every row bound is a constant and the unrolled rows have no exits. */
template <int NW, int C, bool NORM = false, bool EXACT = false>
__global__ void __launch_bounds__(NW * 32)
    k_router_pf(const uint16_t *__restrict__ w, const uint16_t *__restrict__ x, uint32_t n_expert,
                uint32_t dim, float temp, float *__restrict__ logits, uint8_t *__restrict__ ximg,
                unsigned long long *stamps, k_rnorm nm)
{
    static_assert(!NORM || (NW * 64 == SL_EMU_NORM_LANES && C <= K_NORM_E),
                  "k_norm_in_cta's shape");
    if (EXACT) dim = 256 * C; /* the caller's dim: every bound below a constant */
    extern __shared__ int4 k_smem[];
    float *xf = (float *)k_smem;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t e = blockIdx.x * NW + warp, nc = dim / 256;
    /* bench: the CTA's entry, past its wait, end, x in shared memory, the norm's two steps
     * (SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS a CTA) */
    unsigned long long *rec = stamps && threadIdx.x == 0
                                  ? stamps + SL_GPU_RT_ROUTER + SL_GPU_RT_ROUTER_SLOTS * blockIdx.x
                                  : nullptr;
    k_stamp(rec, 0);
    int4 v[C];
    if (e < n_expert) {
        const int4 *row = (const int4 *)(w + (size_t)e * dim);
#pragma unroll
        for (int c = 0; c < C; c++)
            if ((uint32_t)c < nc) v[c] = k_ld_stream(row + lane + 32 * c);
    }
    constexpr int NE = EXACT ? C : K_NORM_E; /* the norm's rows of room */
    float2 wv[NE];                           /* NORM: the norm weights, loaded before the wait */
    if (NORM) {
        k_norm_w<NE>(nm, dim, wv);
        /* L2 asked for the residual stream now, a hint: written a layer ago (and read
         * past the wait through L2 whatever this fetched); with the weights' copies
         * evict-first (SL_BULK_EF) it may still be there, and the layer measured the
         * same without the hint (session 26) */
        if (threadIdx.x == 0) {
            const uint32_t b = dim * 2, lo = b * blockIdx.x / gridDim.x & ~15u,
                           hi = b * (blockIdx.x + 1) / gridDim.x & ~15u;
            if (hi > lo) k_prefetch_l2((const uint8_t *)nm.h + lo, hi - lo);
        }
    }
    k_pdl_wait();
    k_pdl_go();
    k_stamp(rec, 1);
    if (NORM) {
        k_norm_in_cta<NE>(nm, dim, xf + dim, xf, wv, rec);
    } else {
        /* x widened into shared memory, 8 values a 16-byte load, all the loads of a
         * thread issued before the first store (one latency: dim <= 256 C) */
        constexpr int XL = (32 * C + NW * 32 - 1) / (NW * 32); /* 16-byte loads a thread */
        int4 xv[XL];
#pragma unroll
        for (int l = 0; l < XL; l++) {
            const uint32_t i = threadIdx.x + l * NW * 32;
            if (i < dim / 8) xv[l] = *(const int4 *)(x + 8 * i);
        }
#pragma unroll
        for (int l = 0; l < XL; l++) {
            const uint32_t i = threadIdx.x + l * NW * 32;
            if (i >= dim / 8) break;
            const int4 q = xv[l];
            const uint32_t u[4] = {(uint32_t)q.x, (uint32_t)q.y, (uint32_t)q.z, (uint32_t)q.w};
            float4 lo, hi;
            lo.x = sl_emu_float(u[0] << 16), lo.y = sl_emu_float(u[0] & 0xffff0000u);
            lo.z = sl_emu_float(u[1] << 16), lo.w = sl_emu_float(u[1] & 0xffff0000u);
            hi.x = sl_emu_float(u[2] << 16), hi.y = sl_emu_float(u[2] & 0xffff0000u);
            hi.z = sl_emu_float(u[3] << 16), hi.w = sl_emu_float(u[3] & 0xffff0000u);
            *(float4 *)(xf + 4 * i) = lo; /* k_xf_at */
            *(float4 *)(xf + dim / 2 + 4 * i) = hi;
        }
    }
    __syncthreads();
    k_stamp(rec, 3);
    if (ximg) { /* k_quant_x_img's work, a block of 32 a warp, over the grid */
        int8_t *aq = (int8_t *)ximg;
        float *ad = (float *)(aq + dim + dim / 8);
        int *as = (int *)(ad + dim / 32);
        for (uint32_t b = blockIdx.x * NW + warp; b < dim / 32; b += gridDim.x * NW)
            k_quant_block<true>(xf[k_xf_at(32 * b + lane, dim)], b, lane, aq, ad, as);
    }
    if (e >= n_expert) {
        k_stamp(rec, 2);
        return;
    }
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < C; c++) {
        if ((uint32_t)c >= nc) break;
        const float4 lo = *(const float4 *)(xf + 4 * (lane + 32 * c)),
                     hi = *(const float4 *)(xf + dim / 2 + 4 * (lane + 32 * c)); /* k_xf_at */
        const float a[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        const uint32_t u[4] = {(uint32_t)v[c].x, (uint32_t)v[c].y, (uint32_t)v[c].z,
                               (uint32_t)v[c].w};
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc = sl_emu_fma(a[j], sl_emu_float(j & 1 ? u[j >> 1] & 0xffff0000u : u[j >> 1] << 16),
                             acc);
    }
    acc = k_butterfly(acc, 16);
    if (temp != 1.0f) acc = sl_emu_div(acc, temp);
    if (lane == 0) logits[e] = acc;
    k_stamp(rec, 2);
}

/* What the device's selection hands the host (pinned, mapped memory). */
struct sl_kroute {
    uint32_t expert[SL_GPU_MAX_USED]; /* by rank */
    float weight[SL_GPU_MAX_USED];
    uint32_t started;           /* bit r: rank r's gate/up was queued by the device */
    sl_kexp e[SL_GPU_MAX_USED]; /* by slot (increasing expert id), the started ones */
    uint32_t seq;               /* written last: the routing's number (the host spins on it) */
};

/* A selection key: larger is better, as router.c orders them (the larger key first,
 * the lower index on equal keys): the key's bits made monotonic as an unsigned (-0 as
 * +0, so that the two are equal as router.c's float compare has them), then the index
 * complemented. NaN is never given (it is -inf by then). Padding threads keep 0, below
 * every expert's key (-inf gives 0x007fffff in the upper word). */
__device__ __forceinline__ unsigned long long k_sel_key(float kv, uint32_t e)
{
    const uint32_t u = __float_as_uint(kv == 0.0f ? 0.0f : kv);
    const uint32_t o = u >> 31 ? ~u : u | 0x80000000u;
    return (unsigned long long)o << 32 | ~e;
}

/* The selection's milestone: %globaltimer at slot, the SM's clock64 at SL_GPU_RT_SEL_CLK
 * + slot (bench: whether a slow phase ran at a lower clock or waited). */
__device__ __forceinline__ void k_stamp_sel(unsigned long long *rec, uint32_t slot)
{
    if (!rec) return;
    rec[SL_GPU_RT_SEL_CLK + slot] = (unsigned long long)clock64();
    k_stamp(rec, slot);
}

/* score.h's log1p table, copied into the selection's shared memory before its wait
 * (a lookup there is one shared-memory load on the score's path, not an L2 round trip). */
static __device__ const double k_score_tab[SL_SCORE_TAB_N][2] = SL_SCORE_TAB_INIT;

/* The selection of router.c on the device, bit for bit (router.h states the rules):
 * scores by score.h, keys = score + bias (NaN -> -inf), the k best keys with the lower
 * index first on ties, weights from the unbiased scores. One CTA, thread e owns expert
 * e (n_expert <= 1024), keys compared as k_sel_key's 64-bit words (all distinct). The
 * k-th largest of the warps' maxima, T, is a lower bound of the k-th largest key, so
 * only keys >= T can be picked, and of those only a warp's k best: at most k of each
 * of the k warps whose maximum is >= T, one of the warp whose maximum is T (every
 * warp's k best when there are fewer than k warps): k (k - 1) + 1 <= 57 candidates,
 * usually k or a few more. Each warp lists its own (one shared-memory atomic a warp),
 * then warp 0 ranks the list, each candidate counting those before it, and does the
 * rest alone: two CTA barriers in all after the wait (every loop over the warps'
 * maxima, the picks and their scores unrolled, so that their loads are in flight at
 * once: session 23, 0.3 us off the selection).
 * `forced` (nullable; a synthetic routing) replaces the picks and weights after they
 * were computed. Then each pick's slot (its place in increasing expert id) and, for
 * the picks the device tier holds (t0[expert].gate not NULL; t0 nullable), the table
 * of k_gateup_tma_dev_q2_k, plus the shared expert `sh` when with_sh, published by
 * and, with ttab, its tagged form (sl_kttab, every word tagged ttag), before the picks
 * go to the host. The device tier's entries are read before the wait for the router
 * (thread e its expert's, through L2: sl_gpu_t0_set changes them in stream order, and
 * the kernels before the router have completed when this one starts) into shared
 * memory, where warp 0 finds its picks'. stamps (nullable, bench): thread 0's
 * milestones, SL_GPU_RT_SEL_*. */
__global__ void __launch_bounds__(1024)
    k_route_select(const float *__restrict__ logits, const float *__restrict__ bias,
                   uint32_t n_expert, uint32_t k, int norm_topk, float route_scale,
                   const sl_gpu_t0e *__restrict__ t0, const sl_moe_route *forced, sl_kroute *out,
                   sl_ktab *tab, sl_kexp sh, int with_sh, uint32_t seq, sl_kttab *ttab,
                   unsigned ttag, unsigned long long *stamps)
{
    constexpr uint32_t MAXC = SL_GPU_MAX_USED * SL_GPU_MAX_USED;
    __shared__ __align__(16) unsigned long long wmax[32], ckey[MAXC];
    __shared__ float cscore[MAXC], pscore[SL_GPU_MAX_USED];
    __shared__ uint32_t n_cand, pick[SL_GPU_MAX_USED];
    __shared__ sl_gpu_t0e t0all[1024];
    __shared__ double stab[SL_SCORE_TAB_N][2];
    const uint32_t e = threadIdx.x, lane = e & 31, warp = e >> 5, nw = blockDim.x >> 5;
    const float b = bias && e < n_expert ? bias[e] : 0.0f;
    if (t0 && e < n_expert) {
        const unsigned long long *q = (const unsigned long long *)(t0 + e);
        t0all[e] = (sl_gpu_t0e){(const void *)__ldcg(q), (const void *)__ldcg(q + 1),
                                (const void *)__ldcg(q + 2)};
    }
    /* forced sits in host memory (mapped): each read crosses the bus, so the k threads
     * of the picks (in warp 0) read theirs at once, before the wait (the host wrote it
     * before the launch) */
    uint32_t f_ex = 0;
    float f_wt = 0.0f;
    if (forced && e < k) {
        f_ex = forced->expert[e];
        f_wt = forced->weight[e];
    }
    for (uint32_t i = e; i < SL_SCORE_TAB_N; i += blockDim.x) {
        stab[i][0] = k_score_tab[i][0];
        stab[i][1] = k_score_tab[i][1];
    }
    if (e == 0) n_cand = 0;
    if (e >= nw && e < 32) wmax[e] = 0; /* past the last warp: below every key */
    unsigned long long *rec = stamps && e == 0 ? stamps : nullptr;
    k_stamp_sel(rec, SL_GPU_RT_SEL_ENTRY);
    if (rec) rec[SL_GPU_RT_SEL_SM] = k_smid() + 1ull;
    __syncthreads(); /* stab and wmax's padding, before the wait: off the layer's path */
    /* wait first, then let the gate/up start: the gate/up reads the router's x image
     * before its own wait, relying on this order (k_gateup_tma_body, DEV) */
    k_pdl_wait();
    k_pdl_go();
    k_stamp_sel(rec, SL_GPU_RT_SEL_WAITED);
    float sc = 0.0f;
    unsigned long long key = 0;
    if (e < n_expert) {
        sc = sl_score_tab(logits[e], stab);
        float kv = bias ? sl_emu_add(sc, b) : sc;
        if (kv != kv) kv = -INFINITY;
        key = k_sel_key(kv, e);
    }
    const uint32_t hi = __reduce_max_sync(~0u, (uint32_t)(key >> 32));
    const uint32_t lo = __reduce_max_sync(~0u, (uint32_t)(key >> 32) == hi ? (uint32_t)key : 0u);
    if (lane == 0) wmax[warp] = (unsigned long long)hi << 32 | lo;
    __syncthreads();
    k_stamp_sel(rec, SL_GPU_RT_SEL_SCORED);
    /* every warp: T, the k-th largest warp maximum (0, below every key, with fewer than
     * k warps) */
    const unsigned long long mw = lane < nw ? wmax[lane] : 0ull;
    uint32_t above = 0;
#pragma unroll
    for (uint32_t j = 0; j < 32; j += 2) { /* all loads at once; the zeros count for none */
        const ulonglong2 m2 = *(const ulonglong2 *)(wmax + j);
        above += (m2.x > mw) + (m2.y > mw);
    }
    const uint32_t at = __ballot_sync(~0u, lane < nw && above == k - 1);
    const unsigned long long thr = at ? __shfl_sync(~0u, mw, __ffs(at) - 1) : 0ull;
    bool cand = e < n_expert && key >= thr;
    uint32_t mask = __ballot_sync(~0u, cand);
    if ((uint32_t)__popc(mask) > k) { /* the warp's k best only: no other is among all's */
        uint32_t rank = 0;
        for (uint32_t m = mask; m; m &= m - 1) rank += __shfl_sync(~0u, key, __ffs(m) - 1) > key;
        cand = cand && rank < k;
        mask = __ballot_sync(~0u, cand);
    }
    if (mask) {
        uint32_t base = 0;
        if (lane == 0) base = atomicAdd(&n_cand, (uint32_t)__popc(mask));
        base = __shfl_sync(~0u, base, 0);
        if (cand) {
            const uint32_t c = base + __popc(mask & ((1u << lane) - 1));
            ckey[c] = key;
            cscore[c] = sc;
        }
    }
    __syncthreads();
    if (warp) return;
    const uint32_t nc = n_cand;
    for (uint32_t c = lane; c < nc; c += 32) {
        const unsigned long long kc = ckey[c];
        uint32_t rank = 0;
#pragma unroll 4
        for (uint32_t j = 0; j < nc; j++) rank += ckey[j] > kc;
        if (rank < k) {
            pick[rank] = ~(uint32_t)kc;
            pscore[rank] = cscore[c];
        }
    }
    __syncwarp();
    if (forced && e < k) pick[e] = f_ex;
    __syncwarp();
    k_stamp_sel(rec, SL_GPU_RT_SEL_RANKED);
    /* Warp 0, lane r < k: rank r. Every lane adds the k scores in rank order (the
     * reference's sum). */
    const uint32_t r = lane;
    const bool mine = r < k;
    float ps[SL_GPU_MAX_USED]; /* loaded at once, added in rank order */
#pragma unroll
    for (uint32_t q = 0; q < SL_GPU_MAX_USED; q++) ps[q] = q < k ? pscore[q] : 0.0f;
    float sum = 0.0f;
#pragma unroll
    for (uint32_t q = 0; q < SL_GPU_MAX_USED; q++)
        if (q < k) sum = sl_emu_add(sum, ps[q]);
    const float denom = sl_emu_add(sum, 1e-20f);
    uint32_t ex = 0;
    float wt = 0.0f;
    sl_gpu_t0e d = {NULL, NULL, NULL};
    if (mine) {
        ex = pick[r];
        wt = forced      ? f_wt
             : norm_topk ? sl_emu_mul(sl_emu_div(pscore[r], denom), route_scale)
                         : sl_emu_mul(pscore[r], route_scale);
        if (t0) d = t0all[ex];
    }
    uint32_t slot = 0; /* sl_emu_moe_order: increasing expert id, stable */
#pragma unroll
    for (uint32_t q = 0; q < SL_GPU_MAX_USED; q++) {
        const uint32_t eq = __shfl_sync(~0u, ex, q);
        slot += q < k && (eq < ex || (eq == ex && q < r));
    }
    const uint32_t started = __ballot_sync(~0u, mine && d.gate != NULL);
    k_stamp_sel(rec, SL_GPU_RT_SEL_TIER);
    const bool st = mine && (started >> r & 1);
    const sl_kexp ke = {(const uint8_t *)d.gate, (const uint8_t *)d.up, (const uint8_t *)d.down, wt,
                        (int)slot};
    const int n = __popc(started);
    if (ttab) { /* first, the gate/up waits for it: every word, tagged ttag */
        const unsigned long long tag = ttag;
        const int tot = n + with_sh;
        /* a pick's lane its entry (by rank among the started), lane k the shared expert's */
        const int i = st ? __popc(started & ((1u << r) - 1)) : (r == k && with_sh ? n : -1);
        if (i >= 0) { /* the shared expert rides along (slot k); its fields are picked
                       * one by one (a reference to ke or sh put both in local memory) */
            const uint8_t *g = st ? ke.gate : sh.gate, *u = st ? ke.up : sh.up;
            const float xw = st ? ke.w : sh.w;
            const int xs = st ? ke.slot : sh.slot;
            k_st_relaxed64(ttab->w + 1 + 3 * i, (unsigned long long)g | tag);
            k_st_relaxed64(ttab->w + 2 + 3 * i, (unsigned long long)u | tag);
            k_st_relaxed64(ttab->w + 3 + 3 * i, (unsigned long long)__float_as_uint(xw) << 32 |
                                                    (unsigned long long)xs << 4 | tag);
        }
        if ((int)lane >= tot && lane < SL_GPU_MAX_USED) /* entries past n: the tag alone */
            for (int j = 1; j <= 3; j++) k_st_relaxed64(ttab->w + 3 * lane + j, tag);
        if (lane == 0) k_st_relaxed64(ttab->w, (unsigned long long)tot << 4 | tag);
    }
    k_stamp_sel(rec, SL_GPU_RT_SEL_PUBLISHED);
    if (st) tab->e[__popc(started & ((1u << r) - 1))] = ke; /* by rank among the started */
    if (lane == 0) {
        if (with_sh) tab->e[n] = sh; /* the shared expert rides along (slot k) */
        tab->n = n + with_sh;
        tab->pk = (1u << (n + with_sh)) - 1; /* the device tier's downs are tiled */
    }
    if (mine) {
        out->expert[r] = ex;
        out->weight[r] = wt;
        if (st) out->e[slot] = ke;
    }
    if (lane == 0) out->started = started;
    __threadfence_system(); /* every lane's writes reach the host before the number */
    __syncwarp();
    if (lane == 0) *(volatile uint32_t *)&out->seq = seq;
    k_stamp_sel(rec, SL_GPU_RT_SEL_END);
}

/* Entries of the device tier's table: table[index[i]] = value[i], in order. */
struct sl_kt0set {
    uint32_t n;
    uint32_t index[16];
    sl_gpu_t0e value[16];
};
__global__ void k_t0_set(sl_gpu_t0e *table, const __grid_constant__ sl_kt0set set)
{
    if (threadIdx.x == 0)
        for (uint32_t i = 0; i < set.n; i++) table[set.index[i]] = set.value[i];
}

/* Stand-alone q8_1 quantization of bf16 x into sl_block_q8_1 blocks (one warp per
 * block); s is the f32 sum of the 32 inputs in index order, as the CPU quantizer. */
__global__ void k_quant_q8_1(const uint16_t *__restrict__ x, uint32_t n, sl_block_q8_1 *dst)
{
    const int lane = threadIdx.x & 31;
    const uint32_t b = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (b >= n / 32) return;
    const float v = sl_emu_bf16_to_f32(x[32 * b + lane]);
    float d;
    const int q = k_q8_lane(v, &d);
    float s = 0.0f;
    for (int k = 0; k < 32; k++) s = sl_emu_add(s, __shfl_sync(~0u, v, k));
    dst[b].qs[lane] = (int8_t)q;
    if (lane == 0) {
        dst[b].d = d;
        dst[b].s = s;
    }
}

/* Dynamic shared memory of the register-staged gate/up and down. */
inline size_t k_gateup_smem(uint32_t dim, int nw, int maxv)
{
    return dim + dim / 32 * 4 + dim / 16 * 4 + (size_t)nw * (2 * maxv * 32 + 2) * 16;
}
inline size_t k_down2_smem(int n, int maxv)
{
    return (size_t)n * (maxv * 32 + 1) * 16;
}
/* One row of a Q2_K table into bf16, a value a thread (sl_emu_embed_q2_k). */
__global__ void k_embed_q2_k(const uint8_t *__restrict__ table, uint32_t row, uint32_t dim,
                             uint16_t *__restrict__ h)
{
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= dim) return;
    const uint8_t *blk = table + ((size_t)row * (dim / 256) + i / 256) * 84;
    h[i] = sl_emu_bf16_bits(sl_emu_q2_k_value(blk, i % 256));
}

} /* namespace */

/* The residual and the next layer's ffn_norm (sl_emu_residual_norm's arithmetic), one
 * CTA of SL_EMU_NORM_LANES threads: thread j owns elements j, j + lanes, ... (it adds
 * their squares in increasing i), the lanes' sums meet in a shared-memory tree in the
 * emulation's pairing. y or w may be NULL (no residual; no norm); the residual goes to
 * h_out (h itself, or another buffer). */
template <int E>
static __global__ void __launch_bounds__(SL_EMU_NORM_LANES)
    k_residual_norm(const uint16_t *h, const uint16_t *__restrict__ y, const float *__restrict__ w,
                    float eps, uint32_t dim, uint16_t *__restrict__ x, uint16_t *h_out)
{
    __shared__ float s[SL_EMU_NORM_LANES];
    const uint32_t j = threadIdx.x, ne = dim / SL_EMU_NORM_LANES;
    k_pdl_go(); /* the router may load its weights meanwhile (it waits for x) */
    /* E > 0: thread j keeps its ne <= E elements in registers, every load issued at
     * once; E == 0: any dim, element by element. Same operations, same order. The
     * weights are loaded before the wait for the kernel before (the down, which writes
     * y; launched with PDL, this CTA starts while it drains). */
    uint16_t hv[E > 0 ? E : 1], yv[E > 0 ? E : 1];
    float wv[E > 0 ? E : 1];
    if (E > 0 && w) {
#pragma unroll
        for (int q = 0; q < E; q++)
            if ((uint32_t)q < ne) wv[q] = w[j + q * SL_EMU_NORM_LANES];
    }
    k_pdl_wait();
    float acc = 0.0f;
    if (E > 0) {
#pragma unroll
        for (int q = 0; q < E; q++)
            if ((uint32_t)q < ne) {
                hv[q] = h[j + q * SL_EMU_NORM_LANES];
                if (y) yv[q] = y[j + q * SL_EMU_NORM_LANES];
            }
#pragma unroll
        for (int q = 0; q < E; q++)
            if ((uint32_t)q < ne) {
                if (y) {
                    hv[q] = sl_emu_bf16_bits(
                        sl_emu_add(sl_emu_bf16_to_f32(hv[q]), sl_emu_bf16_to_f32(yv[q])));
                    h_out[j + q * SL_EMU_NORM_LANES] = hv[q];
                }
                const float v = sl_emu_bf16_to_f32(hv[q]);
                acc = sl_emu_add(acc, sl_emu_mul(v, v));
            }
    } else {
        for (uint32_t i = j; i < dim; i += SL_EMU_NORM_LANES) {
            uint16_t hb = h[i];
            if (y) {
                hb = sl_emu_bf16_bits(sl_emu_add(sl_emu_bf16_to_f32(hb), sl_emu_bf16_to_f32(y[i])));
                h_out[i] = hb;
            }
            const float v = sl_emu_bf16_to_f32(hb);
            acc = sl_emu_add(acc, sl_emu_mul(v, v));
        }
    }
    if (!w) return;
    s[j] = acc;
    __syncthreads();
    for (uint32_t off = SL_EMU_NORM_LANES / 2; off; off >>= 1) {
        if (j < off) s[j] = sl_emu_add(s[j], s[j + off]);
        __syncthreads();
    }
    const float r = sl_emu_div(1.0f, sl_emu_sqrt(sl_emu_add(sl_emu_div(s[0], (float)dim), eps)));
    if (E > 0) {
#pragma unroll
        for (int q = 0; q < E; q++)
            if ((uint32_t)q < ne) {
                const uint32_t i = j + q * SL_EMU_NORM_LANES;
                x[i] =
                    sl_emu_bf16_bits(sl_emu_mul(wv[q], sl_emu_mul(sl_emu_bf16_to_f32(hv[q]), r)));
            }
    } else {
        for (uint32_t i = j; i < dim; i += SL_EMU_NORM_LANES)
            x[i] = sl_emu_bf16_bits(sl_emu_mul(w[i], sl_emu_mul(sl_emu_bf16_to_f32(h_out[i]), r)));
    }
}

#endif
