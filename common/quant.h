/* quant.h - tensor element types of GGUF files and the K-quant block formats.
 *
 * Type ids are the ggml ids that GGUF files store. Every type here has a fixed
 * block (block_elems values in block_bytes bytes); dims along ne0 must be a
 * multiple of block_elems. Decoders turn blocks into f32 and are bit-exact with
 * the reference definitions of the formats (ggml's dequantize_row_*: same f32
 * operations in the same order, no fused multiply-add). Quantizers reimplement
 * the reference (_ref) algorithms of ggml (make_qkx2_quants, make_q3_quants,
 * make_qx_quants, amax/127) with their parameters, so that synthetic blocks look
 * like real ones. q8_1 is the activation format of the GPU kernels.
 *
 * All functions are pure and thread-safe; none allocates. Block data in memory
 * needs no alignment (it is read and written bytewise or through memcpy), which
 * matters for expert slices and Q3_K's 110-byte blocks. The host must be
 * little-endian, as GGUF is (checked at compile time).
 */
#ifndef SL_QUANT_H
#define SL_QUANT_H

#include <stdint.h>
#include <stddef.h>

enum sl_qtype {
    SL_QTYPE_F32 = 0,
    SL_QTYPE_F16 = 1,
    SL_QTYPE_Q4_0 = 2,
    SL_QTYPE_Q4_1 = 3,
    SL_QTYPE_Q5_0 = 6,
    SL_QTYPE_Q5_1 = 7,
    SL_QTYPE_Q8_0 = 8,
    SL_QTYPE_Q8_1 = 9, /* ggml's on-disk q8_1 (f16 d and s, 36 bytes), not sl_block_q8_1 */
    SL_QTYPE_Q2_K = 10,
    SL_QTYPE_Q3_K = 11,
    SL_QTYPE_Q4_K = 12,
    SL_QTYPE_Q5_K = 13,
    SL_QTYPE_Q6_K = 14,
    SL_QTYPE_Q8_K = 15,
    SL_QTYPE_I8 = 24,
    SL_QTYPE_I16 = 25,
    SL_QTYPE_I32 = 26,
    SL_QTYPE_I64 = 27,
    SL_QTYPE_F64 = 28,
    SL_QTYPE_BF16 = 30,
    SL_QTYPE_COUNT = 31, /* one past the largest id known here */
};

#define SL_QK_K 256 /* values per K-quant super-block */
#define SL_QK8  32  /* values per Q8_0 / q8_1 block */

typedef struct sl_qtype_info {
    const char *name;     /* "Q2_K", as GGUF tools spell it (upper case) */
    uint32_t block_elems; /* values per block (1 for plain types) */
    uint32_t block_bytes; /* bytes per block */
    int decodable;        /* 1 when sl_quant_decode handles it */
    int encodable;        /* 1 when sl_quant_encode handles it */
} sl_qtype_info;

/* Facts about a type id; NULL for ids that are not known (unknown tensor type).
 * Decodable: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K Q8_K.
 * Encodable: F32 F16 BF16 Q8_0 Q2_K Q3_K Q4_K Q6_K. The integer types, F64 and
 * ggml's Q8_1 are known (sizes) but neither. */
const sl_qtype_info *sl_qtype_get(uint32_t type);

/* Bytes of n values of type; 0 when type is unknown, n is not a whole number of
 * blocks, or the size does not fit in 64 bits (sizes read from untrusted files). */
uint64_t sl_qtype_row_bytes(uint32_t type, uint64_t n);

/* ---- block layouts (little-endian, packed exactly as on disk) ---- */

typedef uint16_t sl_f16;  /* IEEE half, raw bits */
typedef uint16_t sl_bf16; /* bfloat16, raw bits */

typedef struct sl_block_q8_0 {
    sl_f16 d; /* scale: value = d * q */
    int8_t qs[SL_QK8];
} sl_block_q8_0; /* 34 bytes */

/* Value i (0..255): code ((qs[32*(i/128) + i%32] >> 2*((i%128)/32)) & 3),
 * sub-block i/16: value = d*(scales & 0xF) * code - dmin*(scales >> 4). */
typedef struct sl_block_q2_k {
    uint8_t scales[SL_QK_K / 16]; /* low 4 bits: scale, high 4 bits: min */
    uint8_t qs[SL_QK_K / 4];      /* 2-bit codes */
    sl_f16 d;                     /* super-block scale of the scales */
    sl_f16 dmin;                  /* super-block scale of the mins */
} sl_block_q2_k;                  /* 84 bytes */

/* Value i: low bits as Q2_K; code = low - 4 when bit i/32 of hmask[i%32] is clear,
 * low when set (range -4..3). Scale k (0..15) is 6 bits stored +32: low 4 bits in
 * scales[k] (k < 8) or scales[k-8] >> 4, high 2 bits at bit 2*(k/4) of
 * scales[8 + k%4]; value = d * (scale - 32) * code. */
typedef struct sl_block_q3_k {
    uint8_t hmask[SL_QK_K / 8]; /* high bit of each 3-bit code */
    uint8_t qs[SL_QK_K / 4];    /* low 2 bits of each code */
    uint8_t scales[12];         /* 16 6-bit scales, packed */
    sl_f16 d;
} sl_block_q3_k; /* 110 bytes */

/* Sub-block j (0..7) of 32 values: 6-bit scale and min in scales[] (get_scale_min_k4
 * packing: j < 4 in the low 6 bits of [j] and [j+4]; j >= 4 low nibbles in [j+4],
 * high 2 bits in the top bits of [j-4] and [j]); value = d*sc * code - dmin*m.
 * Codes: nibble (i%64)/32 of qs[32*(i/64) + i%32]. */
typedef struct sl_block_q4_k {
    sl_f16 d;
    sl_f16 dmin;
    uint8_t scales[12]; /* 8 6-bit scales and 8 6-bit mins, packed */
    uint8_t qs[SL_QK_K / 2];
} sl_block_q4_k; /* 144 bytes */

/* As Q4_K, with a fifth code bit (+16) at bit i/32 of qh[i%32]. */
typedef struct sl_block_q5_k {
    sl_f16 d;
    sl_f16 dmin;
    uint8_t scales[12];
    uint8_t qh[SL_QK_K / 8];
    uint8_t qs[SL_QK_K / 2];
} sl_block_q5_k; /* 176 bytes */

/* Value i = 128*h + 32*g + l: low nibble (g < 2) or high nibble (g >= 2) of
 * ql[64*h + 32*(g&1) + l], high 2 bits at bit 2*g of qh[32*h + l];
 * value = d * scales[i/16] * (code - 32). */
typedef struct sl_block_q6_k {
    uint8_t ql[SL_QK_K / 2];     /* low 4 bits */
    uint8_t qh[SL_QK_K / 4];     /* high 2 bits */
    int8_t scales[SL_QK_K / 16]; /* 8-bit scales */
    sl_f16 d;
} sl_block_q6_k; /* 210 bytes */

/* q8_1 activation block as the GPU kernels use it (sluice's own, never on disk):
 *   amax = max |x_i| (fmaxf, so a NaN input is skipped as on the GPU),
 *   d    = amax / 127 (an f32 division, not a multiplication by 1/127),
 *   q_i  = roundf(x_i / d): nearest, halves away from zero (2.5 -> 3, -2.5 -> -3);
 *          when amax == 0, d = 0 and every q_i = 0,
 *   s    = x_0 + x_1 + ... + x_31, the f32 inputs (not the codes) summed in index
 *          order in f32.
 * d and s are kept in f32 (the activation is small; precision beats bytes here).
 * Unlike ggml's q8_1 (SL_QTYPE_Q8_1: f16 d and s, 36 bytes). */
typedef struct sl_block_q8_1 {
    float d;
    float s;
    int8_t qs[SL_QK8];
} sl_block_q8_1; /* 40 bytes */

/* ---- scalar conversions (bit-exact, round to nearest even) ---- */

/* Exact (every half is an f32): subnormals, signed zeros, inf; NaN stays NaN. */
float sl_f16_to_f32(sl_f16 h);
/* RNE with subnormal results; overflow (>= 65520 in magnitude) gives inf; NaN gives
 * a quiet NaN with the sign and the top payload bits. */
sl_f16 sl_f32_to_f16(float f);
float sl_bf16_to_f32(sl_bf16 h);
sl_bf16 sl_f32_to_bf16(float f); /* RNE; NaN stays NaN (quiet) */

/* Decodes n values (a whole number of blocks, sl_qtype_row_bytes(type, n) bytes at
 * src) of type into dst. Returns 0, or SL_EINVAL (dst untouched) when the type is
 * unknown or not decodable, n is not a whole number of blocks, or a pointer is NULL
 * with n > 0. */
int sl_quant_decode(uint32_t type, const void *src, float *dst, uint64_t n);

/* Quantizes n values (a whole number of blocks) with the reference algorithm of
 * type (F32, F16, BF16, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K) into
 * sl_qtype_row_bytes(type, n) bytes at dst. Returns 0 or SL_EINVAL. Cost on
 * one x86-64 core, per value: Q2_K and Q4_K ~20-40 ns (their scale searches), Q6_K
 * ~35, Q3_K ~15, Q8_0 ~5; callers with much data spread rows over threads. Inputs must
 * be finite: a NaN or inf gives unspecified (but memory-safe) blocks. */
int sl_quant_encode(uint32_t type, const float *src, void *dst, uint64_t n);

/* Quantizes n activations (a multiple of 32) into n/32 q8_1 blocks, with the
 * semantics written at sl_block_q8_1. Returns 0 or SL_EINVAL. */
int sl_quant_q8_1(const float *src, sl_block_q8_1 *dst, uint64_t n);

#endif
