/* quant.h - tensor element types of GGUF files and the K-quant block formats.
 *
 * Type ids are the ggml ids that GGUF files store. Every type here has a fixed
 * block (block_elems values in block_bytes bytes); dims along ne0 must be a
 * multiple of block_elems. Decoders turn blocks into f32 and are bit-exact with
 * the reference definitions of the formats (same f32 operations in the same
 * order). Quantizers reproduce the reference (_ref) algorithms so that synthetic
 * blocks look like real ones. q8_1 is the activation format of the GPU kernels.
 *
 * All functions are pure and thread-safe; none allocates.
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
    SL_QTYPE_Q8_1 = 9,
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
#define SL_QK8 32   /* values per Q8_0 / q8_1 block */

typedef struct sl_qtype_info {
    const char *name;     /* "Q2_K", as ggml spells it */
    uint32_t block_elems; /* values per block (1 for plain types) */
    uint32_t block_bytes; /* bytes per block */
    int decodable;        /* 1 when sl_quant_decode handles it */
    int encodable;        /* 1 when sl_quant_encode handles it */
} sl_qtype_info;

/* Facts about a type id; NULL for ids that are not known (unknown tensor type). */
const sl_qtype_info *sl_qtype_get(uint32_t type);

/* Bytes of n values of type; 0 when type is unknown or n is not a whole number of
 * blocks. */
uint64_t sl_qtype_row_bytes(uint32_t type, uint64_t n);

/* ---- block layouts (little-endian, packed exactly as on disk) ---- */

typedef uint16_t sl_f16;  /* IEEE half, raw bits */
typedef uint16_t sl_bf16; /* bfloat16, raw bits */

typedef struct sl_block_q8_0 {
    sl_f16 d;
    int8_t qs[SL_QK8];
} sl_block_q8_0; /* 34 bytes */

typedef struct sl_block_q2_k {
    uint8_t scales[SL_QK_K / 16]; /* low 4 bits: scale, high 4 bits: min */
    uint8_t qs[SL_QK_K / 4];      /* 2-bit codes */
    sl_f16 d;                     /* super-block scale of the scales */
    sl_f16 dmin;                  /* super-block scale of the mins */
} sl_block_q2_k;                  /* 84 bytes */

typedef struct sl_block_q3_k {
    uint8_t hmask[SL_QK_K / 8]; /* high bit of each 3-bit code */
    uint8_t qs[SL_QK_K / 4];    /* low 2 bits of each code */
    uint8_t scales[12];         /* 16 6-bit scales, packed */
    sl_f16 d;
} sl_block_q3_k; /* 110 bytes */

typedef struct sl_block_q4_k {
    sl_f16 d;
    sl_f16 dmin;
    uint8_t scales[12]; /* 8 6-bit scales and 8 6-bit mins, packed */
    uint8_t qs[SL_QK_K / 2];
} sl_block_q4_k; /* 144 bytes */

typedef struct sl_block_q5_k {
    sl_f16 d;
    sl_f16 dmin;
    uint8_t scales[12];
    uint8_t qh[SL_QK_K / 8];
    uint8_t qs[SL_QK_K / 2];
} sl_block_q5_k; /* 176 bytes */

typedef struct sl_block_q6_k {
    uint8_t ql[SL_QK_K / 2];     /* low 4 bits */
    uint8_t qh[SL_QK_K / 4];     /* high 2 bits */
    int8_t scales[SL_QK_K / 16]; /* 8-bit scales */
    sl_f16 d;
} sl_block_q6_k; /* 210 bytes */

/* q8_1 activation block as the GPU kernels use it: d = amax/127, q = round half away
 * from zero of x/d, s = the sum of the 32 f32 inputs (not of the codes). d and s are
 * kept in f32 (the activation is small; precision beats bytes here). */
typedef struct sl_block_q8_1 {
    float d;
    float s;
    int8_t qs[SL_QK8];
} sl_block_q8_1; /* 40 bytes */

/* ---- scalar conversions (bit-exact, round to nearest even) ---- */
float sl_f16_to_f32(sl_f16 h);
sl_f16 sl_f32_to_f16(float f);
float sl_bf16_to_f32(sl_bf16 h);
sl_bf16 sl_f32_to_bf16(float f); /* RNE; NaN stays NaN (quiet) */

/* Decodes n values (a whole number of blocks) of type from src into dst.
 * Returns 0, or SL_EINVAL when the type is not decodable or n is not a whole
 * number of blocks. */
int sl_quant_decode(uint32_t type, const void *src, float *dst, uint64_t n);

/* Quantizes n values (a whole number of blocks) with the reference algorithm of
 * type (F32, F16, BF16, Q8_0, Q2_K, Q3_K, Q4_K, Q6_K). Returns 0 or SL_EINVAL. */
int sl_quant_encode(uint32_t type, const float *src, void *dst, uint64_t n);

/* Quantizes n activations (a multiple of 32) into n/32 q8_1 blocks, GPU semantics. */
int sl_quant_q8_1(const float *src, sl_block_q8_1 *dst, uint64_t n);

#endif
