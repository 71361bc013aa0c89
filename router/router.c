/* router.c - the MoE gate: lane-ordered router logits, sqrt-softplus scores, top-k
 * with the lower-index tie rule, routing weights. The orders are specified in
 * router.h; the GPU router kernel and the selection of the compute process depend on
 * them bit for bit, so changing one is a protocol change.
 *
 * Built as ISO C11 (no -ffast-math, no FP contraction): every f32 operation here is
 * the one written.
 */
#include "router.h"

#include <math.h>
#include <string.h>

#include "quant.h"
#include "score.h"

#define LANES      32
#define LANE_ELEMS 8

static int is_finite_positive(float v)
{
    return isfinite(v) && v > 0.0f;
}

/* x . w of one expert in the lane order of router.h. */
static float dot_lanes(const uint16_t *x, const uint16_t *w, uint32_t dim)
{
    float acc[LANES] = {0};
    const uint32_t n_run = dim / LANE_ELEMS;
    for (uint32_t r = 0; r < n_run; r++) {
        float *a = &acc[r % LANES];
        const uint16_t *xr = x + (size_t)r * LANE_ELEMS, *wr = w + (size_t)r * LANE_ELEMS;
        for (int j = 0; j < LANE_ELEMS; j++)
            *a = fmaf(sl_bf16_to_f32(xr[j]), sl_bf16_to_f32(wr[j]), *a);
    }
    /* The butterfly: after step off, lanes l and l ^ off hold the same value (f32
     * addition commutes), so only the lower half needs computing for lane 0. */
    for (int off = LANES / 2; off >= 1; off /= 2)
        for (int l = 0; l < off; l++) acc[l] = acc[l] + acc[l + off];
    return acc[0];
}

int sl_router_logits(const uint16_t *x_bf16, const uint16_t *w_bf16, uint32_t n_expert,
                     uint32_t dim, float gate_temp, float *logits, sl_err *err)
{
    if (!x_bf16 || !w_bf16 || !logits)
        return sl_err_set(err, SL_EINVAL, "sl_router_logits: NULL pointer");
    if (dim == 0 || dim % SL_ROUTER_DIM_ALIGN != 0)
        return sl_err_set(err, SL_EINVAL,
                          "sl_router_logits(dim %u): dim must be a positive multiple of %d", dim,
                          SL_ROUTER_DIM_ALIGN);
    if (n_expert == 0) return sl_err_set(err, SL_EINVAL, "sl_router_logits: n_expert is 0");
    if (!is_finite_positive(gate_temp))
        return sl_err_set(err, SL_EINVAL,
                          "sl_router_logits(gate_temp %g): must be finite and positive",
                          (double)gate_temp);
    for (uint32_t e = 0; e < n_expert; e++) {
        logits[e] = dot_lanes(x_bf16, w_bf16 + (size_t)e * dim, dim) / gate_temp;
    }
    return 0;
}

float sl_router_score(float logit)
{
    return sl_score(logit);
}

/* Whether the key score(logit) + b certainly falls below kth (so the expert cannot
 * enter the kept top-k), decided without computing the score: softplus(l) <=
 * max(l, 0) + ln 2, so score <= sqrt(max(l, 0) + 0.6932); compare squares, with a
 * relative margin (1e-5) far above the one-ulp error of sl_score and an absolute
 * one (1e-6 of |kth| + |b|) above the roundings of kth - b and of score + b. Most
 * experts of a layer are skipped this way once k keys are kept; the picks and their
 * weights are exactly those of computing every score (tests/test_router.c). NaN and
 * infinite inputs never take the shortcut. */
static int score_below(float logit, float b, float kth)
{
    const float d = kth - b;
    const float dm = d - (fabsf(kth) + fabsf(b)) * 1e-6f;
    if (!(dm > 0.0f) || !(dm < INFINITY) || !(logit < INFINITY)) return 0;
    const float ub2 = fmaxf(logit, 0.0f) + 0.6932f;
    return ub2 * (1.0f + 1e-5f) < dm * dm;
}

/* Strict "ranks before" of the selection: larger key, then lower index. Keys are
 * never NaN here (mapped to -inf by the caller). */
static int ranks_before(float ka, uint32_t ia, float kb, uint32_t ib)
{
    return ka > kb || (ka == kb && ia < ib);
}

int sl_router_select(const float *logits, const float *bias, const sl_moe_shape *s,
                     sl_moe_route *out, sl_err *err)
{
    if (!logits || !s || !out) return sl_err_set(err, SL_EINVAL, "sl_router_select: NULL pointer");
    const uint32_t k = s->n_used;
    if (k == 0 || k > SL_ROUTER_MAX_USED || k > s->n_expert)
        return sl_err_set(err, SL_EINVAL,
                          "sl_router_select(n_used %u, n_expert %u): need 1 <= n_used <= "
                          "min(n_expert, %d)",
                          k, s->n_expert, SL_ROUTER_MAX_USED);

    /* Running top-k, sorted best first. Experts arrive in increasing index, so a
     * newcomer goes below every kept entry with an equal key. */
    float key[SL_ROUTER_MAX_USED], score[SL_ROUTER_MAX_USED];
    uint32_t idx[SL_ROUTER_MAX_USED];
    uint32_t n = 0;
    for (uint32_t e = 0; e < s->n_expert; e++) {
        const float b = bias ? bias[e] : 0.0f;
        if (n == k && score_below(logits[e], b, key[k - 1])) continue;
        const float sc = sl_router_score(logits[e]);
        float kv = bias ? sc + b : sc;
        if (isnan(kv)) kv = -INFINITY;
        if (n == k && !ranks_before(kv, e, key[k - 1], idx[k - 1])) continue;
        uint32_t pos = n < k ? n : k - 1;
        while (pos > 0 && ranks_before(kv, e, key[pos - 1], idx[pos - 1])) {
            key[pos] = key[pos - 1];
            score[pos] = score[pos - 1];
            idx[pos] = idx[pos - 1];
            pos--;
        }
        key[pos] = kv;
        score[pos] = sc;
        idx[pos] = e;
        if (n < k) n++;
    }

    memset(out, 0, sizeof *out);
    float sum = 0.0f;
    for (uint32_t r = 0; r < k; r++) sum += score[r];
    const float denom = sum + 1e-20f;
    for (uint32_t r = 0; r < k; r++) {
        out->expert[r] = idx[r];
        out->weight[r] =
            s->norm_topk ? score[r] / denom * s->route_scale : score[r] * s->route_scale;
    }
    return 0;
}

int sl_router_route(const uint16_t *x_bf16, const sl_moe_layer_w *w, const sl_moe_shape *s,
                    float *logits, sl_moe_route *out, sl_err *err)
{
    if (!w || !s) return sl_err_set(err, SL_EINVAL, "sl_router_route: NULL pointer");
    int rc = sl_router_logits(x_bf16, w->router, s->n_expert, s->dim, s->gate_temp, logits, err);
    if (rc) return rc;
    return sl_router_select(logits, w->bias, s, out, err);
}
