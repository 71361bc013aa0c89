/* moe_ref.h - the plain f32 CPU reference of one MoE layer (MODEL.md §7): decode the
 * weight blocks row by row with sl_quant_decode, then textbook math. It is the loose
 * oracle of the GPU path (and of the CPU emulation of its arithmetic): slow, simple,
 * independent of any kernel's summation order.
 *
 * Arithmetic, per expert (x: the bf16 input, W1 gate, W3 up, W2 down):
 *   g_j = f32(bf16(f32(x . W1[j])))   u_j = f32(bf16(f32(x . W3[j])))
 *     dot products accumulate in double in increasing index (each bf16 x f32 product
 *     is exact in double), then round to f32, then to bf16 (the reference's f32-GEMM
 *     output rounded once more to bf16; rounding through f32 rather than straight to
 *     bf16 is what an f32 accumulator does);
 *   clamp (when swiglu_limit > 0): u to [-limit, limit], g to (-inf, limit]; NaN
 *     passes through as in torch.clamp;
 *   h_j = bf16(weight * (silu(g_j) * u_j)), silu(g) = g / (1 + expf(-g)), all f32;
 *   y_d = bf16(f32(h . W2[d])), double accumulation as above.
 * Layer: y = sum of the routed y_e in increasing expert id, then the shared expert's,
 * accumulated in f32 from +0 (the reference's loop order), then bf16(y).
 *
 * Weights are raw blocks of any type sl_quant_decode handles (Q2_K/Q3_K for routed
 * experts, Q2_K/Q3_K or BF16 for the shared one, anything decodable for tests); dim
 * and inter must be multiples of 256. Functions are thread-safe; each allocates its
 * scratch (O(dim + inter) floats) and frees it before returning.
 */
#ifndef SL_MOE_REF_H
#define SL_MOE_REF_H

#include <stdint.h>

#include "err.h"
#include "moe_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which types of the shape an expert's blocks have. */
enum sl_moe_ref_kind {
    SL_MOE_REF_ROUTED = 0, /* gate_type, up_type, down_type */
    SL_MOE_REF_SHARED = 1, /* sh_gate_type, sh_up_type, sh_down_type */
};

/* Optional intermediates of one expert, for per-stage comparisons; any pointer may be
 * NULL. Caller-owned. */
typedef struct sl_moe_ref_trace {
    float *g; /* [inter] f32(bf16(x . W1)), before the clamp */
    float *u; /* [inter] f32(bf16(x . W3)), before the clamp */
    float *h; /* [inter] f32(bf16(weight * silu(g) * u)), the down projection's input */
    float *y; /* [dim] h . W2 in f32, before its bf16 rounding */
} sl_moe_ref_trace;

/* One expert on x ([dim] bf16): y ([dim] bf16, caller-owned) = the expert's output,
 * with the routing weight applied before the down projection (pass 1 for the shared
 * expert: multiplying by 1 is exact). Returns 0, SL_EINVAL (bad shape, type, limit or
 * pointer) or SL_ENOMEM. Cost: 3 * dim * inter multiply-adds plus decoding. */
int sl_moe_ref_expert(const sl_moe_shape *s, enum sl_moe_ref_kind kind, const sl_moe_expert_w *w,
                      const uint16_t *x, float weight, uint16_t *y, const sl_moe_ref_trace *trace,
                      sl_err *err);

/* The layer's expert part with a given route: experts[n_expert] are the routed
 * experts' blocks (only the picked ones are read), shared the shared expert's (NULL:
 * none, for tests). y: [dim] bf16; y_f32: [dim] the f32 sum before rounding, or NULL.
 * The route must name n_used distinct experts below n_expert (else SL_EINVAL). */
int sl_moe_ref_apply(const sl_moe_shape *s, const sl_moe_expert_w *experts,
                     const sl_moe_expert_w *shared, const sl_moe_route *route, const uint16_t *x,
                     uint16_t *y, float *y_f32, sl_err *err);

/* The whole MoE layer: routes x with the router (sl_router_route on lw->router and
 * lw->bias), then sl_moe_ref_apply with lw->shared. route: the decision, or NULL. */
int sl_moe_ref_layer(const sl_moe_shape *s, const sl_moe_layer_w *lw,
                     const sl_moe_expert_w *experts, const uint16_t *x, uint16_t *y, float *y_f32,
                     sl_moe_route *route, sl_err *err);

#ifdef __cplusplus
}
#endif

#endif
