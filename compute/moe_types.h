/* moe_types.h - the shapes and weights of one MoE layer, shared by the CPU f32
 * reference, the CPU emulation of the GPU arithmetic and the CUDA kernels.
 *
 * Weights are the raw GGUF blocks (K-quant or BF16), never dequantized copies.
 * Pointers are borrowed: host memory for the CPU paths, device (or mapped host)
 * memory for the GPU paths.
 */
#ifndef SL_MOE_TYPES_H
#define SL_MOE_TYPES_H

#include <stdint.h>

/* One expert's three projections as raw blocks. */
typedef struct sl_moe_expert_w {
    const void *gate; /* [inter][dim], type shape.gate_type (Q2_K) */
    const void *up;   /* [inter][dim], type shape.up_type (Q2_K) */
    const void *down; /* [dim][inter], type shape.down_type (Q3_K) */
} sl_moe_expert_w;

typedef struct sl_moe_shape {
    uint32_t dim;                                    /* model dim (V4.1: 5120) */
    uint32_t inter;                                  /* expert hidden size (V4.1: 2304) */
    uint32_t n_expert;                               /* routed experts (V4.1: 384) */
    uint32_t n_used;                                 /* experts picked per token (V4.1: 6) */
    uint32_t gate_type, up_type, down_type;          /* routed: Q2_K, Q2_K, Q3_K */
    uint32_t sh_gate_type, sh_up_type, sh_down_type; /* shared: Q2_K/Q2_K/Q3_K, or BF16 */
    float route_scale;                               /* 1.5 */
    int norm_topk;      /* 1: renormalise the picked scores (with the 1e-20 guard) */
    float swiglu_limit; /* 10.0: up clamped to [-l, l], gate to (-inf, l] */
    float gate_temp;    /* 1.0: logits are divided by it */
} sl_moe_shape;

/* The resident (non-expert) weights of one MoE layer. */
typedef struct sl_moe_layer_w {
    const uint16_t *router; /* [n_expert][dim] bf16 (ffn_gate_inp) */
    const float *bias;      /* [n_expert] f32 correction bias (exp_probs_b): selects only */
    sl_moe_expert_w shared; /* the shared expert */
} sl_moe_layer_w;

/* The router's decision for one token. */
typedef struct sl_moe_route {
    uint32_t expert[64]; /* [n_used] picked experts, by rank (best first) */
    float weight[64];    /* [n_used] routing weights (renormalised, times route_scale) */
} sl_moe_route;

#endif
