/* router.h - the MoE gate of DeepSeek-V4.1 (MODEL.md §7 steps 1-4): router logits,
 * sqrt-softplus scores, top-k by score + bias, routing weights.
 *
 * The logits follow one fixed summation order (below) and the selection one fixed
 * sequence of IEEE operations (score.h), which the GPU's router and selection kernels
 * reproduce bit for bit: the GPU may route on its own and the CPU backends and tests
 * get the same experts and weights from this file.
 *
 * Logit order (sl_router_logits). For expert e, 32 lanes l = 0..31; lane l owns the
 * elements i with (i / 8) % 32 == l (runs of 8 consecutive elements, one 16-byte bf16
 * load, lanes interleaved every 256 elements) and walks them in increasing i:
 *     acc_l = fmaf(f32(x_i), f32(W[e][i]), acc_l),   acc_l starting at +0.0f.
 * Then a butterfly: for off = 16, 8, 4, 2, 1, every lane at once does
 *     acc_l = acc_l + acc_(l xor off).
 * All lanes end equal; lane 0 ends with ((a_0 + a_16) + (a_8 + a_24)) + ((a_4 + a_20) +
 * (a_12 + a_28)), then that plus lane 2's like value, then plus lane 1's.
 * logit_e = acc_0 / gate_temp (exact when gate_temp is 1). A bf16 x bf16 product is
 * exact in f32 (8-bit significands), so fmaf and a rounded multiply-then-add agree
 * unless a product overflows or underflows; the order of the additions is what matters.
 *
 * Selection (sl_router_select), for e = 0..n_expert-1:
 *     score_e = sqrt(softplus(logit_e)), softplus(v) = v for v > 20 (PyTorch's
 *               threshold), else log1p(e^v), as score.h computes it: in double from
 *               its own polynomials (libm's and CUDA's expf differ in the last ulp),
 *               rounded once to f32, so that the GPU's selection is bit-identical,
 *     key_e   = score_e + bias_e (f32), a NaN key counts as -inf.
 * The picks are the n_used largest keys, best first; equal keys (including -0 vs +0
 * and the NaN/-inf class) rank the lower expert index first, so the order is total
 * and stable. Weights use the unbiased scores: with norm_topk,
 *     w_r = score_r / (sum + 1e-20f) * route_scale, sum = score_0 + ... in rank order
 * (f32, from 0); without, w_r = score_r * route_scale. An inf logit gives an inf score,
 * which ranks first; normalised weights are then NaN, as in the reference.
 *
 * All functions are pure and thread-safe and allocate nothing.
 */
#ifndef SL_ROUTER_H
#define SL_ROUTER_H

#include <stdint.h>

#include "err.h"
#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SL_ROUTER_MAX_USED  64  /* capacity of sl_moe_route */
#define SL_ROUTER_DIM_ALIGN 256 /* 32 lanes x 8 elements: dim must be a multiple */

/* Router logits of one token: logits[e] = (x . W[e]) / gate_temp in the lane order of
 * the file comment. x: [dim] bf16; w: [n_expert][dim] bf16 (ffn_gate_inp); logits:
 * [n_expert] f32, caller-owned. Returns 0, or SL_EINVAL when dim is not a positive
 * multiple of 256, n_expert is 0, gate_temp is not finite and > 0, or a pointer is
 * NULL. Cost: n_expert * dim fused multiply-adds. */
int sl_router_logits(const uint16_t *x_bf16, const uint16_t *w_bf16, uint32_t n_expert,
                     uint32_t dim, float gate_temp, float *logits, sl_err *err);

/* sqrt(softplus(logit)) in f32, as the selection computes it. */
float sl_router_score(float logit);

/* Scores, top-k and weights from n_expert logits (shape fields used: n_expert, n_used,
 * norm_topk, route_scale). bias: [n_expert] f32, or NULL for none. Fills out->expert and
 * out->weight [0, n_used) by rank and zeroes the entries past n_used. Returns 0, or
 * SL_EINVAL (out untouched) when n_used is 0, above 64 or above n_expert, or a pointer
 * is NULL. Cost: O(n_expert * n_used) compares, at most n_expert scores. */
int sl_router_select(const float *logits, const float *bias, const sl_moe_shape *s,
                     sl_moe_route *out, sl_err *err);

/* sl_router_logits with w->router and s->gate_temp, then sl_router_select with w->bias.
 * logits: [n_expert] caller-owned scratch that holds the logits on return. */
int sl_router_route(const uint16_t *x_bf16, const sl_moe_layer_w *w, const sl_moe_shape *s,
                    float *logits, sl_moe_route *out, sl_err *err);

#ifdef __cplusplus
}
#endif

#endif
