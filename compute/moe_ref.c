/* moe_ref.c - the plain f32 CPU reference of one MoE layer; the arithmetic is
 * specified in moe_ref.h. Clarity over speed: one weight row decoded at a time,
 * dot products in double, nothing fused.
 *
 * Built as ISO C11 (no FP contraction): each f32 operation is the one written.
 */
#include "moe_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "router.h"

#define DIM_ALIGN 256

static int check_type(uint32_t type, const char *what, sl_err *err)
{
    const sl_qtype_info *qi = sl_qtype_get(type);
    if (!qi || !qi->decodable)
        return sl_err_set(err, SL_EINVAL, "moe_ref: %s type %u (%s) cannot be decoded", what, type,
                          qi ? qi->name : "unknown");
    return 0;
}

static int check_shape(const sl_moe_shape *s, sl_err *err)
{
    if (s->dim == 0 || s->dim % DIM_ALIGN || s->inter == 0 || s->inter % DIM_ALIGN)
        return sl_err_set(err, SL_EINVAL,
                          "moe_ref(dim %u, inter %u): both must be positive multiples of %d",
                          s->dim, s->inter, DIM_ALIGN);
    if (!(s->swiglu_limit >= 0.0f))
        return sl_err_set(err, SL_EINVAL, "moe_ref(swiglu_limit %g): must be >= 0 (0: no clamp)",
                          (double)s->swiglu_limit);
    return 0;
}

/* x . row, row being n values of type at src, decoded into buf[n]; double sum in
 * increasing index. */
static double dot_row(uint32_t type, const void *src, const float *x, float *buf, uint32_t n)
{
    const int rc = sl_quant_decode(type, src, buf, n);
    SL_ASSERT(rc == 0); /* types and sizes were checked by the caller */
    double acc = 0.0;
    for (uint32_t i = 0; i < n; i++) acc += (double)x[i] * (double)buf[i];
    return acc;
}

static float round_bf16(float v)
{
    return sl_bf16_to_f32(sl_f32_to_bf16(v));
}

static float silu(float g)
{
    return g / (1.0f + expf(-g));
}

int sl_moe_ref_expert(const sl_moe_shape *s, enum sl_moe_ref_kind kind, const sl_moe_expert_w *w,
                      const uint16_t *x, float weight, uint16_t *y, const sl_moe_ref_trace *trace,
                      sl_err *err)
{
    if (!s || !w || !x || !y) return sl_err_set(err, SL_EINVAL, "sl_moe_ref_expert: NULL pointer");
    if (!w->gate || !w->up || !w->down)
        return sl_err_set(err, SL_EINVAL, "sl_moe_ref_expert: missing gate, up or down blocks");
    if (kind != SL_MOE_REF_ROUTED && kind != SL_MOE_REF_SHARED)
        return sl_err_set(err, SL_EINVAL, "sl_moe_ref_expert: kind %d", (int)kind);
    int rc = check_shape(s, err);
    if (rc) return rc;
    const int shared = kind == SL_MOE_REF_SHARED;
    const uint32_t t_gate = shared ? s->sh_gate_type : s->gate_type;
    const uint32_t t_up = shared ? s->sh_up_type : s->up_type;
    const uint32_t t_down = shared ? s->sh_down_type : s->down_type;
    if ((rc = check_type(t_gate, "gate", err)) || (rc = check_type(t_up, "up", err)) ||
        (rc = check_type(t_down, "down", err)))
        return rc;

    const uint32_t dim = s->dim, inter = s->inter;
    /* Whole blocks per row: the types are decodable and dim, inter multiples of 256. */
    const uint64_t rb_gate = sl_qtype_row_bytes(t_gate, dim);
    const uint64_t rb_up = sl_qtype_row_bytes(t_up, dim);
    const uint64_t rb_down = sl_qtype_row_bytes(t_down, inter);
    if (!rb_gate || !rb_up || !rb_down)
        return sl_err_set(err, SL_EINVAL, "sl_moe_ref_expert(dim %u, inter %u): not whole blocks",
                          dim, inter);

    const uint32_t n_row = dim > inter ? dim : inter;
    float *xf = malloc(sizeof(float) * ((size_t)dim + n_row + inter));
    if (!xf)
        return sl_err_set(err, SL_ENOMEM, "sl_moe_ref_expert: malloc(%zu floats)",
                          (size_t)dim + n_row + inter);
    float *row = xf + dim, *h = row + n_row;
    for (uint32_t i = 0; i < dim; i++) xf[i] = sl_bf16_to_f32(x[i]);

    const float limit = s->swiglu_limit;
    const uint8_t *gate = w->gate, *up = w->up, *down = w->down;
    for (uint32_t j = 0; j < inter; j++) {
        float g = round_bf16((float)dot_row(t_gate, gate + j * rb_gate, xf, row, dim));
        float u = round_bf16((float)dot_row(t_up, up + j * rb_up, xf, row, dim));
        if (trace && trace->g) trace->g[j] = g;
        if (trace && trace->u) trace->u[j] = u;
        if (limit > 0.0f) {
            if (u > limit) u = limit;
            if (u < -limit) u = -limit;
            if (g > limit) g = limit;
        }
        const float act = silu(g) * u;
        h[j] = round_bf16(weight * act);
    }
    if (trace && trace->h) memcpy(trace->h, h, sizeof(float) * inter);

    for (uint32_t d = 0; d < dim; d++) {
        const float v = (float)dot_row(t_down, down + d * rb_down, h, row, inter);
        if (trace && trace->y) trace->y[d] = v;
        y[d] = sl_f32_to_bf16(v);
    }
    free(xf);
    return 0;
}

int sl_moe_ref_apply(const sl_moe_shape *s, const sl_moe_expert_w *experts,
                     const sl_moe_expert_w *shared, const sl_moe_route *route, const uint16_t *x,
                     uint16_t *y, float *y_f32, sl_err *err)
{
    if (!s || !experts || !route || !x || !y)
        return sl_err_set(err, SL_EINVAL, "sl_moe_ref_apply: NULL pointer");
    int rc = check_shape(s, err);
    if (rc) return rc;
    const uint32_t k = s->n_used;
    if (k == 0 || k > SL_ROUTER_MAX_USED || k > s->n_expert)
        return sl_err_set(err, SL_EINVAL,
                          "sl_moe_ref_apply(n_used %u, n_expert %u): need 1 <= n_used <= "
                          "min(n_expert, %d)",
                          k, s->n_expert, SL_ROUTER_MAX_USED);

    /* Ranks in increasing expert id (insertion sort of at most 64), checking the ids. */
    uint32_t order[SL_ROUTER_MAX_USED];
    for (uint32_t r = 0; r < k; r++) {
        const uint32_t e = route->expert[r];
        if (e >= s->n_expert)
            return sl_err_set(err, SL_EINVAL, "sl_moe_ref_apply: rank %u names expert %u of %u", r,
                              e, s->n_expert);
        uint32_t pos = r;
        while (pos > 0 && route->expert[order[pos - 1]] > e) {
            order[pos] = order[pos - 1];
            pos--;
        }
        if (pos > 0 && route->expert[order[pos - 1]] == e)
            return sl_err_set(err, SL_EINVAL, "sl_moe_ref_apply: expert %u picked twice", e);
        order[pos] = r;
    }

    const uint32_t dim = s->dim;
    float *acc = calloc(dim, sizeof *acc);
    uint16_t *ye = malloc(sizeof *ye * dim);
    if (!acc || !ye) {
        rc = sl_err_set(err, SL_ENOMEM, "sl_moe_ref_apply: malloc(dim %u)", dim);
        goto fail;
    }
    for (uint32_t i = 0; i < k; i++) {
        const uint32_t r = order[i], e = route->expert[r];
        rc = sl_moe_ref_expert(s, SL_MOE_REF_ROUTED, &experts[e], x, route->weight[r], ye, NULL,
                               err);
        if (rc) {
            sl_err_prefix(err, "expert %u", e);
            goto fail;
        }
        for (uint32_t d = 0; d < dim; d++) acc[d] += sl_bf16_to_f32(ye[d]);
    }
    if (shared) {
        rc = sl_moe_ref_expert(s, SL_MOE_REF_SHARED, shared, x, 1.0f, ye, NULL, err);
        if (rc) {
            sl_err_prefix(err, "shared expert");
            goto fail;
        }
        for (uint32_t d = 0; d < dim; d++) acc[d] += sl_bf16_to_f32(ye[d]);
    }
    for (uint32_t d = 0; d < dim; d++) y[d] = sl_f32_to_bf16(acc[d]);
    if (y_f32) memcpy(y_f32, acc, sizeof(float) * dim);
fail:
    free(acc);
    free(ye);
    return rc;
}

int sl_moe_ref_layer(const sl_moe_shape *s, const sl_moe_layer_w *lw,
                     const sl_moe_expert_w *experts, const uint16_t *x, uint16_t *y, float *y_f32,
                     sl_moe_route *route, sl_err *err)
{
    if (!s || !lw || s->n_expert == 0)
        return sl_err_set(err, SL_EINVAL, "sl_moe_ref_layer: NULL pointer or no experts");
    float *logits = malloc(sizeof *logits * s->n_expert);
    if (!logits)
        return sl_err_set(err, SL_ENOMEM, "sl_moe_ref_layer: malloc(%u logits)", s->n_expert);
    sl_moe_route rt;
    int rc = sl_router_route(x, lw, s, logits, &rt, err);
    free(logits);
    if (rc) return rc;
    rc = sl_moe_ref_apply(s, experts, &lw->shared, &rt, x, y, y_f32, err);
    if (rc == 0 && route) *route = rt;
    return rc;
}
