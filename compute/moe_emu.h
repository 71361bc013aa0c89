/* moe_emu.h - a CPU emulation of the GPU arithmetic of one MoE layer (compute/moe.cu).
 *
 * The kernels and this emulation share the scalar steps below (SL_HD functions): the
 * same source is compiled for the host and, through compute/moe_kern.cuh, for the
 * device, with every rounding spelled out (fmaf, and on the device __fmul_rn,
 * __fadd_rn, __fdiv_rn, __fmaf_rn, so that nvcc cannot contract or reorder them). The
 * integer parts (q8_1 codes, dp4a sums per group of 32) are exact in any order; the
 * f32 parts follow the kernels' lanes: which lane owns which group, the order in
 * which a lane accumulates, and the xor butterfly that combines lanes. That makes
 * every stage bit-exact with the GPU (docs/kernels.md says how and why).
 *
 * Expert weights are raw GGUF blocks (Q2_K gate/up, Q3_K down; the shared expert
 * may also be BF16), never dequantized. Everything here is pure and thread-safe;
 * sl_emu_moe allocates its scratch (it is a test oracle, not a hot path).
 */
#ifndef SL_MOE_EMU_H
#define SL_MOE_EMU_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "err.h"
#include "quant.h"
#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- scalar steps shared with the kernels ---- */

#if defined(__CUDACC__)
#define SL_HD static __host__ __device__ inline
#else
#define SL_HD static inline
#endif

/* Each of these is one IEEE f32 operation, rounded to nearest even, never fused. */
SL_HD float sl_emu_mul(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

SL_HD float sl_emu_add(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

SL_HD float sl_emu_div(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

SL_HD float sl_emu_fma(float a, float b, float c)
{
#ifdef __CUDA_ARCH__
    return __fmaf_rn(a, b, c);
#else
    return fmaf(a, b, c);
#endif
}

SL_HD uint32_t sl_emu_bits(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

SL_HD float sl_emu_float(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

SL_HD float sl_emu_sqrt(float a)
{
#ifdef __CUDA_ARCH__
    return __fsqrt_rn(a);
#else
    return sqrtf(a); /* IEEE: correctly rounded */
#endif
}

/* f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN (as sl_f32_to_bf16). */
SL_HD uint16_t sl_emu_bf16_bits(float f)
{
    uint32_t u = sl_emu_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f32 rounded to bf16 and widened back (the reference's bf16 casts). */
SL_HD float sl_emu_bf16_round(float f)
{
    return sl_emu_float((uint32_t)sl_emu_bf16_bits(f) << 16);
}

SL_HD float sl_emu_bf16_to_f32(uint16_t h)
{
    return sl_emu_float((uint32_t)h << 16);
}

/* IEEE half bits -> f32, exact (every half is an f32). */
SL_HD float sl_emu_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 31) return sl_emu_float(sign | 0x7f800000u | m << 13); /* inf, NaN */
    if (e) return sl_emu_float(sign | (e + 112) << 23 | m << 13);
    /* zero or subnormal: m * 2^-24, exact */
    const float v = sl_emu_mul((float)m, 5.9604644775390625e-08f);
    return sign ? -v : v;
}

/* Value j (0..255) of a Q2_K block (84 bytes: 16 scale/min bytes, 64 code bytes, d,
 * dmin), as sl_quant_decode computes it: (d * scale) * code - dmin * min, each product
 * and the difference rounded apart. j = 128 c + 32 s + 16 half + l reads code byte
 * 32 c + 16 half + l at bits 2s, scale byte 8 c + 2 s + half. */
SL_HD float sl_emu_q2_k_value(const uint8_t *blk, uint32_t j)
{
    const uint32_t c = j >> 7, s = (j >> 5) & 3, half = (j >> 4) & 1, l = j & 15;
    const uint8_t sc = blk[8 * c + 2 * s + half];
    const uint32_t code = (uint32_t)(blk[16 + 32 * c + 16 * half + l] >> (2 * s)) & 3u;
    const float d = sl_emu_f16_to_f32((uint16_t)(blk[80] | blk[81] << 8));
    const float dmin = sl_emu_f16_to_f32((uint16_t)(blk[82] | blk[83] << 8));
    const float dl = sl_emu_mul(d, (float)(sc & 0xF)), ml = sl_emu_mul(dmin, (float)(sc >> 4));
    return sl_emu_add(sl_emu_mul(dl, (float)code), -ml);
}

/* e^x from mul/add/fma only, so that host and device agree bit for bit (libm's expf
 * and CUDA's expf differ in the last ulp). Cody-Waite reduction by ln 2, degree-7
 * Taylor polynomial on |r| <= ln2/2 (relative error < 1e-8 before rounding), scaling
 * by 2^n in two exact steps. Overflow gives +inf, deep underflow +0. */
SL_HD float sl_emu_exp(float x)
{
    if (x != x) return x;
    if (x > 88.72283935546875f) return sl_emu_float(0x7f800000u);
    if (x < -103.972084045410f) return 0.0f;
    const float n = rintf(sl_emu_mul(x, 1.44269502162933349609375f));
    float r = sl_emu_fma(-n, 0.693145751953125f, x);  /* ln2 high part, exact n*hi */
    r = sl_emu_fma(-n, 1.428606765330187045e-06f, r); /* ln2 low part */
    float p = 1.98412698412698e-4f;                   /* 1/7! */
    p = sl_emu_fma(p, r, 1.38888888888889e-3f);       /* 1/6! */
    p = sl_emu_fma(p, r, 8.33333333333333e-3f);       /* 1/5! */
    p = sl_emu_fma(p, r, 4.16666666666667e-2f);       /* 1/4! */
    p = sl_emu_fma(p, r, 1.66666666666667e-1f);       /* 1/3! */
    p = sl_emu_fma(p, r, 0.5f);
    p = sl_emu_fma(p, r, 1.0f);
    p = sl_emu_fma(p, r, 1.0f);
    const int ni = (int)n;               /* -150 .. 128 */
    const int n1 = ni / 2, n2 = ni - n1; /* each in -75 .. 64: normal powers of two */
    p = sl_emu_mul(p, sl_emu_float((uint32_t)(n1 + 127) << 23));
    return sl_emu_mul(p, sl_emu_float((uint32_t)(n2 + 127) << 23));
}

/* One row of SwiGLU as MODEL.md §7.5: g and u (raw f32 dot products) rounded to bf16,
 * u clamped to [-limit, limit], g to (-inf, limit], h = silu(g) * u, times the
 * routing weight w, rounded to bf16. silu(g) = g / (1 + e^-g). */
SL_HD float sl_emu_swiglu(float g, float u, float w, float limit)
{
    g = sl_emu_bf16_round(g);
    u = sl_emu_bf16_round(u);
    u = fminf(fmaxf(u, -limit), limit);
    g = fminf(g, limit);
    const float e = sl_emu_exp(-g);
    const float s = sl_emu_div(g, sl_emu_add(1.0f, e));
    float h = sl_emu_mul(s, u);
    h = sl_emu_mul(w, h);
    return sl_emu_bf16_round(h);
}

/* q8_1 code of x in a block with scale d = amax/127 (the sl_block_q8_1 rules):
 * round half away from zero, 0 when amax == 0 or x is NaN, saturated to int8. */
SL_HD int sl_emu_q8_code(float x, float d, float amax)
{
    if (amax == 0.0f) return 0;
    const float r = roundf(sl_emu_div(x, d));
    if (r != r) return 0;
    if (r > 127.0f) return 127;
    if (r < -128.0f) return -128;
    return (int)r;
}

/* The f32 step of one group of 32 values (two 16-value sub-blocks) of a Q2_K row:
 * isum = sum of scale*code*q (both sub-blocks), imin = sum of min*q, d8 the q8_1
 * scale of the activation block; acc += d8 * (d*isum - dmin*imin). */
SL_HD float sl_emu_q2_k_step(float acc, float d, float dmin, int isum, int imin, float d8)
{
    const float p = sl_emu_mul(d, (float)isum);
    const float v = sl_emu_fma(-dmin, (float)imin, p);
    return sl_emu_fma(d8, v, acc);
}

/* Same for Q3_K: isum = sum of (scale-32)*code*q with signed codes; acc += d8*(d*isum). */
SL_HD float sl_emu_q3_k_step(float acc, float d, int isum, float d8)
{
    return sl_emu_fma(d8, sl_emu_mul(d, (float)isum), acc);
}

/* ---- host emulation ---- */

/* An activation quantized to q8_1 the way the kernels keep it: codes, one f32 scale
 * per 32 values, and the integer sum of the codes of each 16 values (Q2_K's mins). */
typedef struct sl_emu_act {
    uint32_t n;     /* values (multiple of 256) */
    int8_t *qs;     /* [n] q8_1 codes */
    float *d;       /* [n/32] scales */
    int32_t *sum16; /* [n/16] sums of 16 codes */
} sl_emu_act;

/* Quantizes x[n] (n % 256 == 0) into act, whose arrays the caller provides. The codes
 * and scales are exactly sl_quant_q8_1's. */
void sl_emu_act_quant(const float *x, uint32_t n, sl_emu_act *act);

/* Dot product of one row (n = act->n values) with the activation, in the kernels'
 * exact lane order: Q2_K as the gate/up kernel (32 lanes), Q3_K as the down kernel
 * (8 lanes per row), BF16 with an f32 activation as the router and the BF16 shared
 * expert (lane l owns elements i with (i/8) % 32 == l). */
float sl_emu_dot_q2_k(const void *row, const sl_emu_act *act);
float sl_emu_dot_q3_k(const void *row, const sl_emu_act *act);
float sl_emu_dot_bf16(const uint16_t *row, const float *x, uint32_t n);

/* Router logits as the GPU router GEMV: bf16 x and w widened, 32-lane order,
 * divided by gate_temp when it is not 1. w is [n_expert][dim]. */
void sl_emu_router_logits(const uint16_t *w, const uint16_t *x, uint32_t n_expert, uint32_t dim,
                          float gate_temp, float *logits);

/* Intermediate values of sl_emu_moe for tests (any pointer may be NULL). */
typedef struct sl_emu_trace {
    float *h;    /* [n_used][inter] SwiGLU outputs (bf16-rounded), experts by increasing id */
    int8_t *hq;  /* [n_used][inter] their q8_1 codes */
    float *hd;   /* [n_used][inter/32] their q8_1 scales */
    float *h_sh; /* [inter] the shared expert's SwiGLU output */
    float *y_sh; /* [dim] the shared expert's output (bf16-rounded) */
} sl_emu_trace;

/* One MoE layer for one token as the GPU computes it: x [dim] bf16, the route (experts
 * and weights by rank), w[n_used] their weights by rank (host memory), shared (NULL for
 * none). out [dim] bf16; out_f32 [dim] (nullable) the f32 sum before the final bf16.
 * Returns 0, SL_EINVAL (shape), SL_EUNSUPPORTED (types) or SL_ENOMEM. */
int sl_emu_moe(const sl_moe_shape *shape, const uint16_t *x, const sl_moe_route *route,
               const sl_moe_expert_w *w, const sl_moe_expert_w *shared, uint16_t *out,
               float *out_f32, sl_emu_trace *trace, sl_err *err);

/* Lanes of the residual + norm kernel: the sum of squares is split over them. */
#define SL_EMU_NORM_LANES 256

/* One row of a Q2_K embedding table (dim values) as bf16 bits: sl_gpu_embed_q2_k's
 * arithmetic, and sl_quant_decode's then sl_f32_to_bf16's, bit for bit where the
 * block's d and dmin are finite (an inf or NaN scale gives NaN on every side, with
 * the NaN's bits the FPU's). */
void sl_emu_embed_q2_k(const uint8_t *row, uint32_t dim, uint16_t *out);

/* The residual and the next layer's ffn_norm as the GPU computes them (MODEL.md §2.1),
 * dim a multiple of SL_EMU_NORM_LANES:
 *   h = bf16(h + y) element by element (y NULL: h unchanged);
 *   when w is not NULL: ss = the sum of h_i^2, lane j of SL_EMU_NORM_LANES adding the
 *   squares of h_j, h_(j+lanes), ... in increasing i, then lanes added pairwise
 *   (for off = lanes/2 down to 1: s_j = s_j + s_(j+off) for j < off);
 *   r = 1 / sqrt(ss / dim + eps); x_i = bf16(w_i * (h_i * r)). */
void sl_emu_residual_norm(uint32_t dim, uint16_t *h, const uint16_t *y, const float *w, float eps,
                          uint16_t *x);

/* The packed Q3_K block, the device layout of downs in sessions 11-20 (the bench
 * sandbox's variants keep it): the 110 bytes of a GGUF block (hmask, qs, scales, d)
 * then 2 zero bytes, so that every block starts 16-byte aligned (a 2304-wide row: 9
 * blocks, 1008 bytes instead of 990). */
#define SL_Q3K_PACKED 112

/* Packs n Q3_K blocks from src (raw, 110 bytes each) into dst (SL_Q3K_PACKED bytes
 * each). */
void sl_emu_pack_q3_k(const uint8_t *src, uint64_t n, uint8_t *dst);

/* The tiled Q3_K layout, the device layout of downs (gpu.h: sl_gpu_upload_down): block
 * b of the 8 rows 8i .. 8i + 7 in SL_Q3K_TB bytes at (i * nb + b) * SL_Q3K_TB, so that
 * an 8-row tile is as long as in packed blocks (8 * nb * SL_Q3K_PACKED). Made for the
 * down kernel's warp, whose lane 8p + g takes group g (32 weights) of rows 2p and 2p + 1:
 * the lane loads its group's activation once for both rows (k_dot_tb_q3_k).
 * Position i of group g is (v, u, t) = (i / 16, i / 4 % 4, i % 4):
 *   lo   [0, 512):   byte 256 (m / 4) + 128 v + 16 g + 4 u + t holds the 2-bit low
 *                    fields of rows 4 (m / 4) .. + 3 at bits 2 (m % 4);
 *   hi   [512, 768): byte 512 + 128 v + 16 g + 4 u + t holds the high bits of the 8
 *                    rows, row m at bit m;
 *   sc   [768, 864): lane l = 8p + g's 24 bits z = the 6-bit scales of sub-blocks 2g,
 *                    2g + 1 of row 2p, then of row 2p + 1 (6 bits each, from bit 0):
 *                    bytes 768 + 2l, 769 + 2l (z's low 16 bits), 832 + l (its high 8);
 *   d    [864, 880): row m's f16 d at 864 + 2m; [880, 896) zero.
 * The values are the raw blocks'; only the layout differs. */
#define SL_Q3K_TB 896

/* The unsigned 6-bit scale of sub-block k (0..15) from a Q3_K block's 12 scale bytes sc
 * (the value is this minus 32). */
SL_HD uint32_t sl_emu_q3_k_scale6(const uint8_t *sc, uint32_t k)
{
    const uint32_t lo = (sc[k & 7] >> (4 * (k >> 3))) & 15u;
    const uint32_t hi = (sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3u;
    return lo | hi << 4;
}

/* Byte q (0 .. SL_Q3K_TB - 1) of the tiled block whose 8 raw blocks (rows m = 0..7) sit
 * at blk0 + m * stride: the layout above, gathered a byte at a time. The one definition
 * of the layout, for sl_emu_pack_q3_k_tb and the GPU's k_pack_q3_k_tb. */
SL_HD uint8_t sl_emu_q3_k_tb_byte(const uint8_t *blk0, uint64_t stride, uint32_t q)
{
    uint32_t v = 0;
    if (q < 768) { /* low fields (quad q / 256) or high bits: position k of group g */
        const uint32_t at = q & 255, g = (at >> 4) & 7, k = 16 * (at >> 7) + (at & 15);
        if (q < 512)
            for (uint32_t m = 0; m < 4; m++) {
                const uint8_t *blk = blk0 + (4 * (q >> 8) + m) * stride;
                v |= ((blk[32 + 32 * (g >> 2) + k] >> (2 * (g & 3))) & 3u) << (2 * m);
            }
        else
            for (uint32_t m = 0; m < 8; m++) v |= ((blk0[m * stride + k] >> g) & 1u) << m;
    } else if (q < 864) { /* a byte of lane l's 24 scale bits */
        const uint32_t l = q < 832 ? (q - 768) >> 1 : q - 832;
        const uint32_t sh = q < 832 ? 8 * ((q - 768) & 1) : 16, p = l >> 3, g = l & 7;
        uint32_t z = 0;
        for (uint32_t i = 0; i < 4; i++) /* row 2p + i / 2, sub-block 2g + i % 2 */
            z |= sl_emu_q3_k_scale6(blk0 + (2 * p + i / 2) * stride + 96, 2 * g + i % 2) << (6 * i);
        v = (z >> sh) & 255u;
    } else if (q < 880) { /* row m's d */
        v = blk0[((q - 864) >> 1) * stride + 108 + (q & 1)];
    }
    return (uint8_t)v;
}

/* Tiles rows (a multiple of 8) raw Q3_K rows of nb blocks from src into dst
 * (rows / 8 * nb * SL_Q3K_TB bytes); sl_gpu_upload_down's bytes. */
void sl_emu_pack_q3_k_tb(const uint8_t *src, uint32_t rows, uint32_t nb, uint8_t *dst);

/* Row r (0..7) of an 8-row tile of the tiled layout (nb blocks) times act, as the down
 * kernel's lanes compute it from those bytes: the same bits as sl_emu_dot_q3_k of the
 * raw row (each group's chain over b, then the 8-lane butterfly). */
float sl_emu_dot_q3_k_tb(const uint8_t *tile, uint32_t r, uint32_t nb, const sl_emu_act *act);

/* The order in which the GPU runs and sums the picked experts: ranks sorted by
 * increasing expert id (stable). Writes n_used ranks into order. */
void sl_emu_moe_order(const sl_moe_route *route, uint32_t n_used, uint32_t *order);

#ifdef __cplusplus
}
#endif

#endif
