/* quant.c - GGUF element types: the type table, exact f16/bf16 conversions, the
 * block decoders, the reference quantizers and the q8_1 activation quantizer.
 *
 * Decoders repeat the f32 arithmetic of ggml's dequantize_row_* operation for
 * operation (products taken in the same order, no contraction into fma), so that
 * the CPU oracles and the GPU kernels see the same weights as llama.cpp does.
 * Quantizers follow the algorithms of ggml's quantize_row_*_ref with the same
 * parameters, the same rounding helper (round half to even through the 1.5*2^23
 * trick) and the same f32 expression order, so that synthetic checkpoints carry
 * blocks that look like those of real files.
 *
 * Every block is copied into (or out of) a local struct with memcpy, so callers
 * need no alignment and nothing here is allocated. Scratch lives on the stack.
 */
#include "quant.h"
#include "err.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

/* GCC in ISO mode (-std=c11, as the build uses) does not contract a*b+c into an fma;
 * clang needs to be told. An fma would break bit-exactness with the reference. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "sluice reads GGUF blocks in place and needs a little-endian host"
#endif

_Static_assert(sizeof(sl_block_q8_0) == 34, "q8_0 block size");
_Static_assert(sizeof(sl_block_q2_k) == 84, "q2_K block size");
_Static_assert(sizeof(sl_block_q3_k) == 110, "q3_K block size");
_Static_assert(sizeof(sl_block_q4_k) == 144, "q4_K block size");
_Static_assert(sizeof(sl_block_q5_k) == 176, "q5_K block size");
_Static_assert(sizeof(sl_block_q6_k) == 210, "q6_K block size");
_Static_assert(sizeof(sl_block_q8_1) == 40, "q8_1 activation block size");
_Static_assert(offsetof(sl_block_q2_k, d) == 80, "q2_K layout");
_Static_assert(offsetof(sl_block_q3_k, d) == 108, "q3_K layout");
_Static_assert(offsetof(sl_block_q6_k, d) == 208, "q6_K layout");

/* Blocks of the legacy and auxiliary formats, decoded only. */
#define QK4 32
typedef struct block_q4_0 {
    sl_f16 d;
    uint8_t qs[QK4 / 2]; /* value j: low nibble of qs[j], value j+16: high nibble */
} block_q4_0;            /* 18 bytes */
typedef struct block_q4_1 {
    sl_f16 d;
    sl_f16 m;
    uint8_t qs[QK4 / 2];
} block_q4_1; /* 20 bytes */
typedef struct block_q5_0 {
    sl_f16 d;
    uint8_t qh[4]; /* bit j (little-endian u32): fifth bit of value j */
    uint8_t qs[QK4 / 2];
} block_q5_0; /* 22 bytes */
typedef struct block_q5_1 {
    sl_f16 d;
    sl_f16 m;
    uint8_t qh[4];
    uint8_t qs[QK4 / 2];
} block_q5_1; /* 24 bytes */
typedef struct block_q8_k {
    float d;
    int8_t qs[SL_QK_K];
    int16_t bsums[SL_QK_K / 16]; /* sums of 16 codes, for dot products; unused here */
} block_q8_k;                    /* 292 bytes */
_Static_assert(sizeof(block_q4_0) == 18, "q4_0 block size");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1 block size");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0 block size");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1 block size");
_Static_assert(sizeof(block_q8_k) == 292, "q8_K block size");

/* Below this the reference treats a group as all zero. */
#define GROUP_MAX_EPS 1e-15f

/* ------------------------------------------------------------------ type table */

static const sl_qtype_info k_types[SL_QTYPE_COUNT] = {
    [SL_QTYPE_F32] = {"F32", 1, 4, 1, 1},
    [SL_QTYPE_F16] = {"F16", 1, 2, 1, 1},
    [SL_QTYPE_Q4_0] = {"Q4_0", QK4, sizeof(block_q4_0), 1, 0},
    [SL_QTYPE_Q4_1] = {"Q4_1", QK4, sizeof(block_q4_1), 1, 0},
    [SL_QTYPE_Q5_0] = {"Q5_0", QK4, sizeof(block_q5_0), 1, 0},
    [SL_QTYPE_Q5_1] = {"Q5_1", QK4, sizeof(block_q5_1), 1, 0},
    [SL_QTYPE_Q8_0] = {"Q8_0", SL_QK8, sizeof(sl_block_q8_0), 1, 1},
    [SL_QTYPE_Q8_1] = {"Q8_1", SL_QK8, 36, 0, 0},
    [SL_QTYPE_Q2_K] = {"Q2_K", SL_QK_K, sizeof(sl_block_q2_k), 1, 1},
    [SL_QTYPE_Q3_K] = {"Q3_K", SL_QK_K, sizeof(sl_block_q3_k), 1, 1},
    [SL_QTYPE_Q4_K] = {"Q4_K", SL_QK_K, sizeof(sl_block_q4_k), 1, 1},
    [SL_QTYPE_Q5_K] = {"Q5_K", SL_QK_K, sizeof(sl_block_q5_k), 1, 0},
    [SL_QTYPE_Q6_K] = {"Q6_K", SL_QK_K, sizeof(sl_block_q6_k), 1, 1},
    [SL_QTYPE_Q8_K] = {"Q8_K", SL_QK_K, sizeof(block_q8_k), 1, 0},
    [SL_QTYPE_I8] = {"I8", 1, 1, 0, 0},
    [SL_QTYPE_I16] = {"I16", 1, 2, 0, 0},
    [SL_QTYPE_I32] = {"I32", 1, 4, 0, 0},
    [SL_QTYPE_I64] = {"I64", 1, 8, 0, 0},
    [SL_QTYPE_F64] = {"F64", 1, 8, 0, 0},
    [SL_QTYPE_BF16] = {"BF16", 1, 2, 1, 1},
};

const sl_qtype_info *sl_qtype_get(uint32_t type)
{
    if (type >= SL_QTYPE_COUNT || !k_types[type].name) return NULL;
    return &k_types[type];
}

uint64_t sl_qtype_row_bytes(uint32_t type, uint64_t n)
{
    const sl_qtype_info *qi = sl_qtype_get(type);
    if (!qi || n % qi->block_elems) return 0;
    uint64_t nb = n / qi->block_elems;
    if (nb > UINT64_MAX / qi->block_bytes) return 0;
    return nb * qi->block_bytes;
}

/* ------------------------------------------------------------------ scalars */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float sl_f16_to_f32(sl_f16 h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Rounds the integer q + rem/2^shift to nearest, ties to the even q. */
static inline uint32_t round_shift_rne(uint32_t m, unsigned shift)
{
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return q;
}

sl_f16 sl_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffff;
    if (a > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
        return (sl_f16)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) /* >= 65520 (halfway past 65504): rounds to inf */
        return (sl_f16)(sign | 0x7c00);
    uint32_t e = a >> 23;
    if (e < 113) {
        /* result is subnormal (or zero): round a / 2^-24 to an integer */
        if (e < 102) return sign; /* below 2^-25: rounds to zero */
        uint32_t m = (a & 0x7fffff) | 0x800000;
        return (sl_f16)(sign | round_shift_rne(m, 126 - e));
    }
    /* normal: rebias the exponent, round 23 mantissa bits to 10; a carry out of the
     * mantissa moves to the next binade, as it should */
    uint32_t v = ((e - 112) << 23 | (a & 0x7fffff));
    return (sl_f16)(sign | round_shift_rne(v, 13));
}

float sl_bf16_to_f32(sl_bf16 h)
{
    return bits_f32((uint32_t)h << 16);
}

sl_bf16 sl_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000u) return (sl_bf16)((u >> 16) | 0x0040);
    /* overflow to inf falls out of the carry: 0x7f7f.ffff.. rounds to 0x7f80 */
    return (sl_bf16)round_shift_rne(u, 16);
}

/* ------------------------------------------------------------------ helpers */

static inline float h2f(sl_f16 h)
{
    return sl_f16_to_f32(h);
}

/* The reference's rounding for quantizers: nearest, ties to even, for
 * |f| < 2^22. Adding 1.5*2^23 leaves the integer in the low mantissa bits (the add
 * rounds in the default mode); larger or non-finite inputs give garbage that the
 * callers clamp, without undefined behaviour. */
static inline int round_q(float f)
{
    uint32_t u = f32_bits(f + 12582912.0f);
    return (int)(u & 0x007fffff) - 0x00400000;
}

static inline int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* roundf into int8 for |v| <= 127.5 as the callers guarantee for finite input;
 * saturates, and maps NaN to 0, so that bad input is never undefined behaviour. */
static inline int8_t round_i8(float v)
{
    float r = roundf(v);
    if (!(r == r)) return 0;
    if (r > 127.0f) return 127;
    if (r < -128.0f) return -128;
    return (int8_t)r;
}

/* 6-bit scale and min j (0..7) of a Q4_K/Q5_K block (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ------------------------------------------------------------------ decoders */

static void decode_f16(const uint8_t *p, float *y, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) y[i] = sl_f16_to_f32((sl_f16)(p[2 * i] | p[2 * i + 1] << 8));
}

static void decode_bf16(const uint8_t *p, float *y, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) y[i] = sl_bf16_to_f32((sl_bf16)(p[2 * i] | p[2 * i + 1] << 8));
}

static void decode_q4_0(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(block_q4_0), y += QK4) {
        block_q4_0 b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d);
        for (int j = 0; j < QK4 / 2; j++) {
            const int x0 = (b.qs[j] & 0x0F) - 8;
            const int x1 = (b.qs[j] >> 4) - 8;
            y[j] = x0 * d;
            y[j + QK4 / 2] = x1 * d;
        }
    }
}

static void decode_q4_1(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(block_q4_1), y += QK4) {
        block_q4_1 b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d), m = h2f(b.m);
        for (int j = 0; j < QK4 / 2; j++) {
            const int x0 = b.qs[j] & 0x0F;
            const int x1 = b.qs[j] >> 4;
            y[j] = x0 * d + m;
            y[j + QK4 / 2] = x1 * d + m;
        }
    }
}

static inline uint32_t le32(const uint8_t *q)
{
    return (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
}

static void decode_q5_0(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(block_q5_0), y += QK4) {
        block_q5_0 b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d);
        const uint32_t qh = le32(b.qh);
        for (int j = 0; j < QK4 / 2; j++) {
            const int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
            const int x0 = ((b.qs[j] & 0x0F) | h0 << 4) - 16;
            const int x1 = ((b.qs[j] >> 4) | h1 << 4) - 16;
            y[j] = x0 * d;
            y[j + QK4 / 2] = x1 * d;
        }
    }
}

static void decode_q5_1(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(block_q5_1), y += QK4) {
        block_q5_1 b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d), m = h2f(b.m);
        const uint32_t qh = le32(b.qh);
        for (int j = 0; j < QK4 / 2; j++) {
            const int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
            const int x0 = (b.qs[j] & 0x0F) | h0 << 4;
            const int x1 = (b.qs[j] >> 4) | h1 << 4;
            y[j] = x0 * d + m;
            y[j + QK4 / 2] = x1 * d + m;
        }
    }
}

static void decode_q8_0(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(sl_block_q8_0), y += SL_QK8) {
        sl_block_q8_0 b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d);
        for (int j = 0; j < SL_QK8; j++) y[j] = b.qs[j] * d;
    }
}

static void decode_q8_k(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(block_q8_k), y += SL_QK_K) {
        block_q8_k b;
        memcpy(&b, p, sizeof b);
        for (int j = 0; j < SL_QK_K; j++) y[j] = b.d * b.qs[j];
    }
}

/* Q2_K: per 128 values, 32 bytes of codes hold four 2-bit planes; each plane is
 * two sub-blocks of 16 with their own 4-bit scale and min. */
static void decode_q2_k(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(sl_block_q2_k)) {
        sl_block_q2_k b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d), dmin = h2f(b.dmin);
        const uint8_t *q = b.qs;
        int is = 0;
        for (int h = 0; h < SL_QK_K; h += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++) {
                    const uint8_t sc = b.scales[is++];
                    const float dl = d * (sc & 0xF);
                    const float ml = dmin * (sc >> 4);
                    const uint8_t *qq = q + 16 * half;
                    for (int l = 0; l < 16; l++) *y++ = dl * ((qq[l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/* The 16 signed 6-bit scales of a Q3_K block (stored +32), unpacked. */
static void q3_k_scales(const uint8_t s[12], int sc[16])
{
    for (int k = 0; k < 16; k++) {
        int lo = k < 8 ? s[k] & 0xF : s[k - 8] >> 4;
        int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        sc[k] = (lo | hi << 4) - 32;
    }
}

static void decode_q3_k(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(sl_block_q3_k)) {
        sl_block_q3_k b;
        memcpy(&b, p, sizeof b);
        const float d_all = h2f(b.d);
        int sc[16];
        q3_k_scales(b.scales, sc);
        const uint8_t *q = b.qs;
        int is = 0;
        uint8_t m = 1; /* hmask bit of the current plane: value i uses bit i/32 */
        for (int h = 0; h < SL_QK_K; h += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m = (uint8_t)(m << 1)) {
                for (int half = 0; half < 2; half++) {
                    const float dl = d_all * sc[is++];
                    const uint8_t *qq = q + 16 * half;
                    const uint8_t *hm = b.hmask + 16 * half;
                    for (int l = 0; l < 16; l++)
                        *y++ = dl * (((qq[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
            }
        }
    }
}

static void decode_q4_k(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(sl_block_q4_k)) {
        sl_block_q4_k b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d), dmin = h2f(b.dmin);
        const uint8_t *q = b.qs;
        for (int j = 0; j < SL_QK_K / 32; j += 2, q += 32) {
            uint8_t sc, m;
            scale_min_k4(j, b.scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            scale_min_k4(j + 1, b.scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

static void decode_q5_k(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(sl_block_q5_k)) {
        sl_block_q5_k b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d), dmin = h2f(b.dmin);
        const uint8_t *ql = b.qs;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < SL_QK_K / 32; j += 2, ql += 32) {
            uint8_t sc, m;
            scale_min_k4(j, b.scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            scale_min_k4(j + 1, b.scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) + (b.qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + (b.qh[l] & u2 ? 16 : 0)) - m2;
            u1 = (uint8_t)(u1 << 2);
            u2 = (uint8_t)(u2 << 2);
        }
    }
}

static void decode_q6_k(const uint8_t *p, float *y, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, p += sizeof(sl_block_q6_k)) {
        sl_block_q6_k b;
        memcpy(&b, p, sizeof b);
        const float d = h2f(b.d);
        const uint8_t *ql = b.ql, *qh = b.qh;
        const int8_t *sc = b.scales;
        for (int h = 0; h < SL_QK_K; h += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
                const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                y[l] = d * sc[is] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

int sl_quant_decode(uint32_t type, const void *src, float *dst, uint64_t n)
{
    const sl_qtype_info *qi = sl_qtype_get(type);
    if (!qi || !qi->decodable || n % qi->block_elems) return SL_EINVAL;
    if (n == 0) return 0;
    if (!src || !dst) return SL_EINVAL;
    const uint8_t *p = src;
    const uint64_t nb = n / qi->block_elems;
    switch (type) {
    case SL_QTYPE_F32:
        memcpy(dst, p, n * sizeof(float));
        break;
    case SL_QTYPE_F16:
        decode_f16(p, dst, n);
        break;
    case SL_QTYPE_BF16:
        decode_bf16(p, dst, n);
        break;
    case SL_QTYPE_Q4_0:
        decode_q4_0(p, dst, nb);
        break;
    case SL_QTYPE_Q4_1:
        decode_q4_1(p, dst, nb);
        break;
    case SL_QTYPE_Q5_0:
        decode_q5_0(p, dst, nb);
        break;
    case SL_QTYPE_Q5_1:
        decode_q5_1(p, dst, nb);
        break;
    case SL_QTYPE_Q8_0:
        decode_q8_0(p, dst, nb);
        break;
    case SL_QTYPE_Q8_K:
        decode_q8_k(p, dst, nb);
        break;
    case SL_QTYPE_Q2_K:
        decode_q2_k(p, dst, nb);
        break;
    case SL_QTYPE_Q3_K:
        decode_q3_k(p, dst, nb);
        break;
    case SL_QTYPE_Q4_K:
        decode_q4_k(p, dst, nb);
        break;
    case SL_QTYPE_Q5_K:
        decode_q5_k(p, dst, nb);
        break;
    case SL_QTYPE_Q6_K:
        decode_q6_k(p, dst, nb);
        break;
    default:
        SL_ASSERT(!"decodable type without a decoder");
    }
    return 0;
}

/* ------------------------------------------------------------------ scale searches */

#define FIT_N_MAX     32 /* values per group */
#define FIT_LANES_MAX 16 /* groups per call */

/* ggml's make_qkx2_quants: fits x ~ scale*L - the_min with codes L in 0..nmax and an
 * offset at or below zero, minimizing the w-weighted error (absolute when use_mad,
 * else squared). Starts from the min/max fit; then for nstep+1 trial scales
 * (nmax + rmin + rdelta*is)/(max - min) assigns codes and takes the weighted
 * least-squares scale and offset of that assignment, keeping the best. The offset
 * of the best fit so far feeds the next trial, as in the reference.
 *
 * Runs `lanes` independent groups of n values at once (group j: x[n*j ..], w[n*j ..]).
 * Each lane performs exactly the f32 operations of the one-group algorithm in the
 * same order; only the loops put the lanes innermost, so that the groups' dependency
 * chains overlap (and vectorize) instead of running one after another (2-3x faster).
 * Writes group j's codes to L[n*j ..], its scale to scale_out[j] and its
 * (non-negative) min to min_out[j]. */
static inline __attribute__((always_inline)) void
fit_scale_min(const int n, const int lanes, const int nmax, const float *x, const float *w,
              uint8_t *L, float *scale_out, float *min_out, const float rmin, const float rdelta,
              const int nstep, const int use_mad)
{
    float xt[FIT_N_MAX][FIT_LANES_MAX], wt[FIT_N_MAX][FIT_LANES_MAX];
    int la[FIT_N_MAX][FIT_LANES_MAX];
    float lo[FIT_LANES_MAX], hi[FIT_LANES_MAX], sum_w[FIT_LANES_MAX], sum_x[FIT_LANES_MAX];
    float scale[FIT_LANES_MAX], best[FIT_LANES_MAX], iscale[FIT_LANES_MAX];
    float code_iscale[FIT_LANES_MAX], code_lo[FIT_LANES_MAX]; /* whence the best codes */
    float sum_l[FIT_LANES_MAX], sum_l2[FIT_LANES_MAX], sum_xl[FIT_LANES_MAX];
    float ts[FIT_LANES_MAX], tm[FIT_LANES_MAX], cur[FIT_LANES_MAX];
    int live[FIT_LANES_MAX], ok[FIT_LANES_MAX];

    for (int i = 0; i < n; i++)
        for (int j = 0; j < lanes; j++) {
            xt[i][j] = x[n * j + i];
            wt[i][j] = w[n * j + i];
        }
    for (int j = 0; j < lanes; j++) {
        lo[j] = hi[j] = xt[0][j];
        sum_w[j] = wt[0][j];
        sum_x[j] = sum_w[j] * xt[0][j];
    }
    for (int i = 1; i < n; i++)
        for (int j = 0; j < lanes; j++) {
            const float v = xt[i][j];
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = v > hi[j] ? v : hi[j];
            sum_w[j] += wt[i][j];
            sum_x[j] += wt[i][j] * v;
        }
    /* a flat group (max == min after clamping min to <= 0) gets codes 0 and scale 0;
     * its lane still runs, on a dummy range, and its results are dropped */
    for (int j = 0; j < lanes; j++) {
        lo[j] = lo[j] > 0 ? 0.0f : lo[j];
        live[j] = hi[j] != lo[j];
        iscale[j] = nmax / (live[j] ? hi[j] - lo[j] : 1.0f);
        scale[j] = 1 / iscale[j];
        best[j] = 0;
        code_iscale[j] = iscale[j];
        code_lo[j] = lo[j];
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < lanes; j++) {
            const int l = clampi(round_q(iscale[j] * (xt[i][j] - lo[j])), 0, nmax);
            float diff = scale[j] * l + lo[j] - xt[i][j];
            diff = use_mad ? fabsf(diff) : diff * diff;
            best[j] += wt[i][j] * diff;
        }
    for (int is = 0; is <= nstep; is++) {
        for (int j = 0; j < lanes; j++) {
            iscale[j] = (rmin + rdelta * is + nmax) / (live[j] ? hi[j] - lo[j] : 1.0f);
            sum_l[j] = sum_l2[j] = sum_xl[j] = 0;
        }
        for (int i = 0; i < n; i++)
            for (int j = 0; j < lanes; j++) {
                const int l = clampi(round_q(iscale[j] * (xt[i][j] - lo[j])), 0, nmax);
                la[i][j] = l;
                sum_l[j] += wt[i][j] * l;
                sum_l2[j] += wt[i][j] * l * l;
                sum_xl[j] += wt[i][j] * l * xt[i][j];
            }
        for (int j = 0; j < lanes; j++) {
            const float D = sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j];
            ok[j] = live[j] & (D > 0); /* D > 0 implies sum_l2 > 0 */
            const float Dd = ok[j] ? D : 1.0f, l2 = ok[j] ? sum_l2[j] : 1.0f;
            const float s = (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / Dd;
            const float m = (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / Dd;
            const float s0 = sum_xl[j] / l2; /* the fit through the origin, for m > 0 */
            ts[j] = m > 0 ? s0 : s;
            tm[j] = m > 0 ? 0.0f : m;
            cur[j] = 0;
        }
        for (int i = 0; i < n; i++)
            for (int j = 0; j < lanes; j++) {
                float diff = ts[j] * la[i][j] + tm[j] - xt[i][j];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur[j] += wt[i][j] * diff;
            }
        for (int j = 0; j < lanes; j++) {
            ok[j] = ok[j] & (cur[j] < best[j]);
            best[j] = ok[j] ? cur[j] : best[j];
            scale[j] = ok[j] ? ts[j] : scale[j];
            code_iscale[j] = ok[j] ? iscale[j] : code_iscale[j];
            code_lo[j] = ok[j] ? lo[j] : code_lo[j];
            lo[j] = ok[j] ? tm[j] : lo[j];
        }
    }
    for (int j = 0; j < lanes; j++) {
        scale_out[j] = live[j] ? scale[j] : 0.0f;
        min_out[j] = -lo[j];
    }
    /* the kept codes, recomputed from the scale and offset that produced them (the
     * same expression, so the same codes) instead of copied at every improvement */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < lanes; j++)
            la[i][j] = clampi(round_q(code_iscale[j] * (xt[i][j] - code_lo[j])), 0, nmax);
    for (int j = 0; j < lanes; j++)
        for (int i = 0; i < n; i++) L[n * j + i] = (uint8_t)(live[j] ? la[i][j] : 0);
}

/* ggml's make_q3_quants with do_rmse: symmetric codes -nmax..nmax-1, the value of
 * largest magnitude mapped to -nmax, then up to 5 passes of coordinate descent on
 * the x^2-weighted fit, each code moved to its best value given the others when
 * that raises sumlx^2/suml2. L gets codes + nmax; returns the scale. */
static float fit_q3(int n, int nmax, const float *x, int8_t *L)
{
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = clampi(round_q(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                const int new_l = clampi(round_q(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return sumlx / suml2;
}

/* ggml's make_qx_quants with rmse_type 1 and no importance weights (what Q6_K's
 * reference uses): symmetric codes -nmax..nmax-1, weights x^2; tries the scales
 * -(nmax + 0.1*is)/max for is in -9..9 and keeps the one with the largest
 * sumlx^2/suml2, returning its least-squares scale. L gets codes + nmax. */
static float fit_qx(int n, int nmax, const float *x, int8_t *L)
{
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = clampi(round_q(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = clampi(round_q(iscale * x[i]), -nmax, nmax - 1);
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + clampi(round_q(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* ------------------------------------------------------------------ quantizers */

/* Q8_0: d = amax/127, codes roundf(x * (1/d)) with the f32 d (the stored d is its
 * f16 rounding). */
static void encode_q8_0(const float *x, uint8_t *p, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, x += SL_QK8, p += sizeof(sl_block_q8_0)) {
        sl_block_q8_0 b;
        float amax = 0;
        for (int j = 0; j < SL_QK8; j++) {
            const float v = fabsf(x[j]);
            if (v > amax) amax = v;
        }
        const float d = amax / 127;
        const float id = d ? 1.0f / d : 0.0f;
        b.d = sl_f32_to_f16(d);
        for (int j = 0; j < SL_QK8; j++) b.qs[j] = round_i8(x[j] * id);
        memcpy(p, &b, sizeof b);
    }
}

/* Packs 256 2-bit codes: code i at bits 2*((i%128)/32) of byte 32*(i/128) + i%32. */
static void pack_2bit(const uint8_t *L, uint8_t qs[SL_QK_K / 4])
{
    for (int j = 0; j < SL_QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] =
                (uint8_t)(L[j + l] | L[j + l + 32] << 2 | L[j + l + 64] << 4 | L[j + l + 96] << 6);
}

/* Codes of n values against a sub-block's final (scale d, min dm): the nearest level
 * of (x + dm) / d, clamped to [0, nmax] (Q2_K and Q4_K, once their scales are
 * quantized). */
static void codes_against(const float *x, int n, float d, float dm, int nmax, uint8_t *L)
{
    for (int i = 0; i < n; i++) L[i] = (uint8_t)clampi(round_q((x[i] + dm) / d), 0, nmax);
}

/* Q2_K: 16 sub-blocks of 16 fitted by fit_scale_min (nmax 3, |x| weights, absolute
 * error, 16 trial scales from (2.5 + 0.1*is)/(max - min)); their scales and mins are
 * quantized to 4 bits against the largest of each, and every code is then chosen
 * again against the quantized scale and min. */
static void encode_q2_k(const float *x, uint8_t *p, uint64_t nb)
{
    const float q4scale = 15.0f;
    for (uint64_t i = 0; i < nb; i++, x += SL_QK_K, p += sizeof(sl_block_q2_k)) {
        sl_block_q2_k b;
        uint8_t L[SL_QK_K];
        float weights[SL_QK_K], mins[16], scales[16];
        float max_scale = 0, max_min = 0;
        for (int l = 0; l < SL_QK_K; l++) weights[l] = fabsf(x[l]);
        fit_scale_min(16, 16, 3, x, weights, L, scales, mins, -0.5f, 0.1f, 15, 1);
        for (int j = 0; j < 16; j++) {
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = q4scale / max_scale;
            for (int j = 0; j < 16; j++) b.scales[j] = (uint8_t)round_q(iscale * scales[j]);
            b.d = sl_f32_to_f16(max_scale / q4scale);
        } else {
            memset(b.scales, 0, sizeof b.scales);
            b.d = sl_f32_to_f16(0.0f);
        }
        if (max_min > 0) {
            const float iscale = q4scale / max_min;
            for (int j = 0; j < 16; j++)
                b.scales[j] = (uint8_t)(b.scales[j] | (unsigned)round_q(iscale * mins[j]) << 4);
            b.dmin = sl_f32_to_f16(max_min / q4scale);
        } else {
            b.dmin = sl_f32_to_f16(0.0f);
        }
        for (int j = 0; j < 16; j++) {
            const float d = h2f(b.d) * (b.scales[j] & 0xF);
            if (!d) continue;
            const float dm = h2f(b.dmin) * (b.scales[j] >> 4);
            codes_against(x + 16 * j, 16, d, dm, 3, L + 16 * j);
        }
        pack_2bit(L, b.qs);
        memcpy(p, &b, sizeof b);
    }
}

/* Q3_K: 16 sub-blocks of 16 fitted by fit_q3 (codes -4..3); the signed scales are
 * quantized to 6 bits with the one of largest magnitude mapped to -32, stored +32;
 * codes are chosen again against the quantized scales. */
static void encode_q3_k(const float *x, uint8_t *p, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, x += SL_QK_K, p += sizeof(sl_block_q3_k)) {
        sl_block_q3_k b;
        int8_t L[SL_QK_K];
        float scales[16];
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = fit_q3(16, 4, x + 16 * j, L + 16 * j);
            const float scale = fabsf(scales[j]);
            if (scale > amax) {
                amax = scale;
                max_scale = scales[j];
            }
        }
        memset(b.scales, 0, sizeof b.scales);
        if (max_scale) {
            const float iscale = -32.0f / max_scale;
            for (int j = 0; j < 16; j++) {
                const int l = clampi(round_q(iscale * scales[j]), -32, 31) + 32;
                if (j < 8)
                    b.scales[j] = (uint8_t)(l & 0xF);
                else
                    b.scales[j - 8] = (uint8_t)(b.scales[j - 8] | (l & 0xF) << 4);
                b.scales[j % 4 + 8] = (uint8_t)(b.scales[j % 4 + 8] | (l >> 4) << (2 * (j / 4)));
            }
            b.d = sl_f32_to_f16(1 / iscale);
        } else {
            b.d = sl_f32_to_f16(0.0f);
        }
        int sc[16];
        q3_k_scales(b.scales, sc);
        for (int j = 0; j < 16; j++) {
            const float d = h2f(b.d) * sc[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++)
                L[16 * j + ii] = (int8_t)(clampi(round_q(x[16 * j + ii] / d), -4, 3) + 4);
        }
        memset(b.hmask, 0, sizeof b.hmask);
        uint8_t low[SL_QK_K];
        for (int j = 0; j < SL_QK_K; j++) {
            int l = L[j];
            if (l > 3) {
                b.hmask[j % 32] = (uint8_t)(b.hmask[j % 32] | 1 << (j / 32));
                l -= 4;
            }
            low[j] = (uint8_t)l;
        }
        pack_2bit(low, b.qs);
        memcpy(p, &b, sizeof b);
    }
}

/* Q4_K: 8 sub-blocks of 32 fitted by fit_scale_min (nmax 15, weights rms + |x|,
 * squared error, 21 trial scales from (14 + 0.1*is)/(max - min)); scales and mins
 * quantized to 6 bits against the largest of each; codes chosen again. */
static void encode_q4_k(const float *x, uint8_t *p, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, x += SL_QK_K, p += sizeof(sl_block_q4_k)) {
        sl_block_q4_k b;
        uint8_t L[SL_QK_K];
        float weights[SL_QK_K], mins[8], scales[8];
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; j++) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
            const float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; l++) weights[32 * j + l] = av_x + fabsf(x[32 * j + l]);
        }
        fit_scale_min(32, 8, 15, x, weights, L, scales, mins, -1.0f, 0.1f, 20, 0);
        for (int j = 0; j < 8; j++) {
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
        const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
        for (int j = 0; j < 8; j++) {
            uint8_t ls = (uint8_t)round_q(inv_scale * scales[j]);
            uint8_t lm = (uint8_t)round_q(inv_min * mins[j]);
            if (ls > 63) ls = 63;
            if (lm > 63) lm = 63;
            if (j < 4) {
                b.scales[j] = ls;
                b.scales[j + 4] = lm;
            } else {
                b.scales[j + 4] = (uint8_t)((ls & 0xF) | (lm & 0xF) << 4);
                b.scales[j - 4] = (uint8_t)(b.scales[j - 4] | (ls >> 4) << 6);
                b.scales[j] = (uint8_t)(b.scales[j] | (lm >> 4) << 6);
            }
        }
        b.d = sl_f32_to_f16(max_scale / 63.0f);
        b.dmin = sl_f32_to_f16(max_min / 63.0f);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            scale_min_k4(j, b.scales, &sc, &m);
            const float d = h2f(b.d) * sc;
            if (!d) continue;
            const float dm = h2f(b.dmin) * m;
            codes_against(x + 32 * j, 32, d, dm, 15, L + 32 * j);
        }
        for (int j = 0; j < SL_QK_K; j += 64)
            for (int l = 0; l < 32; l++) b.qs[j / 2 + l] = (uint8_t)(L[j + l] | L[j + l + 32] << 4);
        memcpy(p, &b, sizeof b);
    }
}

/* Q6_K: 16 sub-blocks of 16 fitted by fit_qx (codes -32..31); the signed scales are
 * quantized to int8 with the one of largest magnitude mapped to -128; codes chosen
 * again against the quantized scales. */
static void encode_q6_k(const float *x, uint8_t *p, uint64_t nb)
{
    for (uint64_t i = 0; i < nb; i++, x += SL_QK_K, p += sizeof(sl_block_q6_k)) {
        sl_block_q6_k b;
        int8_t L[SL_QK_K];
        float scales[16];
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ib++) {
            scales[ib] = fit_qx(16, 32, x + 16 * ib, L + 16 * ib);
            const float abs_scale = fabsf(scales[ib]);
            if (abs_scale > max_abs_scale) {
                max_abs_scale = abs_scale;
                max_scale = scales[ib];
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&b, 0, sizeof b);
            b.d = sl_f32_to_f16(0.0f);
            memcpy(p, &b, sizeof b);
            continue;
        }
        const float iscale = -128.0f / max_scale;
        b.d = sl_f32_to_f16(1 / iscale);
        for (int ib = 0; ib < 16; ib++) {
            const int l = round_q(iscale * scales[ib]);
            b.scales[ib] = (int8_t)clampi(l, -128, 127);
        }
        for (int j = 0; j < 16; j++) {
            const float d = h2f(b.d) * b.scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ii++)
                L[16 * j + ii] = (int8_t)(clampi(round_q(x[16 * j + ii] / d), -32, 31) + 32);
        }
        uint8_t *ql = b.ql, *qh = b.qh;
        for (int j = 0; j < SL_QK_K; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                const int q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
                const int q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l] = (uint8_t)(q1 | q3 << 4);
                ql[l + 32] = (uint8_t)(q2 | q4 << 4);
                qh[l] = (uint8_t)((L[j + l] >> 4) | (L[j + l + 32] >> 4) << 2 |
                                  (L[j + l + 64] >> 4) << 4 | (L[j + l + 96] >> 4) << 6);
            }
        }
        memcpy(p, &b, sizeof b);
    }
}

int sl_quant_encode(uint32_t type, const float *src, void *dst, uint64_t n)
{
    const sl_qtype_info *qi = sl_qtype_get(type);
    if (!qi || !qi->encodable || n % qi->block_elems) return SL_EINVAL;
    if (n == 0) return 0;
    if (!src || !dst) return SL_EINVAL;
    uint8_t *p = dst;
    const uint64_t nb = n / qi->block_elems;
    switch (type) {
    case SL_QTYPE_F32:
        memcpy(p, src, n * sizeof(float));
        break;
    case SL_QTYPE_F16:
        for (uint64_t i = 0; i < n; i++) {
            const sl_f16 h = sl_f32_to_f16(src[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        break;
    case SL_QTYPE_BF16:
        for (uint64_t i = 0; i < n; i++) {
            const sl_bf16 h = sl_f32_to_bf16(src[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        break;
    case SL_QTYPE_Q8_0:
        encode_q8_0(src, p, nb);
        break;
    case SL_QTYPE_Q2_K:
        encode_q2_k(src, p, nb);
        break;
    case SL_QTYPE_Q3_K:
        encode_q3_k(src, p, nb);
        break;
    case SL_QTYPE_Q4_K:
        encode_q4_k(src, p, nb);
        break;
    case SL_QTYPE_Q6_K:
        encode_q6_k(src, p, nb);
        break;
    default:
        SL_ASSERT(!"encodable type without an encoder");
    }
    return 0;
}

/* ------------------------------------------------------------------ q8_1 */

int sl_quant_q8_1(const float *src, sl_block_q8_1 *dst, uint64_t n)
{
    if (n % SL_QK8) return SL_EINVAL;
    if (n == 0) return 0;
    if (!src || !dst) return SL_EINVAL;
    for (uint64_t i = 0; i < n / SL_QK8; i++, src += SL_QK8) {
        float amax = 0, sum = 0;
        for (int j = 0; j < SL_QK8; j++) {
            amax = fmaxf(amax, fabsf(src[j]));
            sum += src[j];
        }
        const float d = amax / 127;
        sl_block_q8_1 *b = &dst[i];
        for (int j = 0; j < SL_QK8; j++) b->qs[j] = amax == 0 ? 0 : round_i8(src[j] / d);
        b->d = d;
        b->s = sum;
    }
    return 0;
}
