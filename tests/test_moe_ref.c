/* test_moe_ref.c - the f32 CPU reference of one MoE layer.
 *
 * Two kinds of cases:
 *  - hand-checkable ones with BF16 diagonal weights and x = 1, so that g_j, u_j are
 *    chosen numbers and y_j = h_j: the clamps (each side), the routing weight's
 *    place, exact combine order, all checkable value by value;
 *  - synthetic Q2_K/Q3_K experts (sl_quant_encode of seeded random f32) compared,
 *    stage by stage, with an oracle written here: whole matrices decoded at once,
 *    dot products in double summed in decreasing index (the reference goes up).
 *
 * Tolerances and why. Stage checks feed the oracle the reference's own previous
 * stage, so each compares one rounding:
 *   g, u, h: within 1 bf16 ulp, and at least 99% bit-identical: both sides round the
 *     same value (up to double summation order, or f32 vs double silu for h) to bf16,
 *     so they can only disagree when that value sits on a rounding boundary;
 *   y before its bf16 rounding: within 1 f32 ulp (two double sums rounded to f32);
 *   end to end (the oracle's own chain): rms error <= 2^-8 rms(y), max error <=
 *     2^-6 max|y| (a flipped bf16 rounding of g, u or h moves y by about a bf16 ulp
 *     of one term, far below these).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "moe_ref.h"
#include "quant.h"
#include "router.h"

/* ------------------------------------------------------------------ helpers */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r) /* xorshift64 */
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

static float rng_uniform(rng *r) /* [-1, 1) */
{
    return (float)((double)(rng_next(r) >> 40) * 0x1p-24 * 2 - 1);
}

static uint16_t bf(float f)
{
    return sl_f32_to_bf16(f);
}

static float bff(float f) /* f rounded to bf16, as f32 */
{
    return sl_bf16_to_f32(sl_f32_to_bf16(f));
}

static float bf16_ulp(float v) /* spacing of bf16 values at |v| */
{
    int e;
    if (v == 0.0f || !isfinite(v)) return 0x1p-133f;
    frexpf(fabsf(v), &e);
    return ldexpf(1.0f, e - 8);
}

static float f32_ulp(double v)
{
    const float f = fabsf((float)v);
    return nextafterf(f, INFINITY) - f;
}

static int same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

static sl_moe_shape make_shape(uint32_t dim, uint32_t inter, uint32_t n_expert, uint32_t n_used)
{
    sl_moe_shape s;
    memset(&s, 0, sizeof s);
    s.dim = dim;
    s.inter = inter;
    s.n_expert = n_expert;
    s.n_used = n_used;
    s.gate_type = SL_QTYPE_Q2_K;
    s.up_type = SL_QTYPE_Q2_K;
    s.down_type = SL_QTYPE_Q3_K;
    s.sh_gate_type = SL_QTYPE_Q2_K;
    s.sh_up_type = SL_QTYPE_Q2_K;
    s.sh_down_type = SL_QTYPE_Q3_K;
    s.route_scale = 1.5f;
    s.norm_topk = 1;
    s.swiglu_limit = 10.0f;
    s.gate_temp = 1.0f;
    return s;
}

static void set_all_types(sl_moe_shape *s, uint32_t type, int shared)
{
    if (shared)
        s->sh_gate_type = s->sh_up_type = s->sh_down_type = type;
    else
        s->gate_type = s->up_type = s->down_type = type;
}

/* rows x cols f32 values quantized to type, as one GGUF tensor. */
static void *encode(uint32_t type, const float *v, uint32_t rows, uint32_t cols)
{
    const uint64_t bytes = sl_qtype_row_bytes(type, cols) * rows;
    void *p = malloc(bytes);
    cr_assert(p && bytes);
    cr_assert_eq(sl_quant_encode(type, v, p, (uint64_t)rows * cols), 0);
    return p;
}

static float *decode_all(uint32_t type, const void *src, uint32_t rows, uint32_t cols)
{
    float *v = malloc(sizeof(float) * rows * cols);
    cr_assert_eq(sl_quant_decode(type, src, v, (uint64_t)rows * cols), 0);
    return v;
}

/* An expert of random weights: gate/up [inter][dim], down [dim][inter]. */
static sl_moe_expert_w random_expert(rng *r, const uint32_t type[3], uint32_t dim, uint32_t inter,
                                     float amp_in, float amp_down)
{
    float *v = malloc(sizeof(float) * dim * inter);
    sl_moe_expert_w w;
    for (size_t i = 0; i < (size_t)dim * inter; i++) v[i] = amp_in * rng_uniform(r);
    w.gate = encode(type[0], v, inter, dim);
    for (size_t i = 0; i < (size_t)dim * inter; i++) v[i] = amp_in * rng_uniform(r);
    w.up = encode(type[1], v, inter, dim);
    for (size_t i = 0; i < (size_t)dim * inter; i++) v[i] = amp_down * rng_uniform(r);
    w.down = encode(type[2], v, dim, inter);
    free(v);
    return w;
}

static void free_expert(sl_moe_expert_w *w)
{
    free((void *)w->gate);
    free((void *)w->up);
    free((void *)w->down);
    memset(w, 0, sizeof *w);
}

/* A BF16 expert with diagonal gate/up/down (dim == inter): diag values a, b, c. */
static sl_moe_expert_w diag_expert(uint32_t n, const float *a, const float *b, const float *c)
{
    uint16_t *m[3];
    const float *d[3] = {a, b, c};
    for (int k = 0; k < 3; k++) {
        m[k] = calloc((size_t)n * n, sizeof(uint16_t));
        for (uint32_t j = 0; j < n; j++) m[k][(size_t)j * n + j] = bf(d[k][j]);
    }
    sl_moe_expert_w w = {m[0], m[1], m[2]};
    return w;
}

static void random_x(rng *r, uint16_t *x, uint32_t n, float amp)
{
    for (uint32_t i = 0; i < n; i++) x[i] = bf(amp * rng_uniform(r));
}

static double dot_down(const float *row, const float *v, uint32_t n) /* decreasing index */
{
    double acc = 0;
    for (uint32_t i = n; i-- > 0;) acc += (double)row[i] * (double)v[i];
    return acc;
}

static double silu_d(double g)
{
    return g / (1.0 + exp(-g));
}

/* h from g and u by the formula, in double, rounded once to bf16 (through f32). */
static float oracle_h(float g, float u, float limit, float weight)
{
    double gc = g, uc = u;
    if (limit > 0) {
        if (gc > limit) gc = limit;
        if (uc > limit) uc = limit;
        if (uc < -limit) uc = -limit;
    }
    return bff((float)(weight * (silu_d(gc) * uc)));
}

/* Close within tol and mostly bit-identical; returns the number identical. */
static int expect_bf16_close(const float *got, const float *want, uint32_t n, const char *what)
{
    int same = 0;
    for (uint32_t i = 0; i < n; i++) {
        same += same_bits(got[i], want[i]);
        const float tol = bf16_ulp(fmaxf(fabsf(got[i]), fabsf(want[i])));
        cr_expect(fabsf(got[i] - want[i]) <= tol, "%s[%u] = %.9g, oracle %.9g", what, i,
                  (double)got[i], (double)want[i]);
    }
    cr_expect(same * 100 >= (int)n * 99, "%s: only %d of %u bit-identical", what, same, n);
    return same;
}

/* ------------------------------------------------------------------ single expert */

/* Synthetic Q2_K/Q2_K/Q3_K expert, dim != inter (a transposed matrix cannot pass). */
Test(moe_ref_expert, stages_match_double_oracle)
{
    rng r = {0x51ce};
    const uint32_t dim = 512, inter = 256;
    const uint32_t types[3] = {SL_QTYPE_Q2_K, SL_QTYPE_Q2_K, SL_QTYPE_Q3_K};
    sl_moe_shape s = make_shape(dim, inter, 1, 1);
    /* x ~ U(-2, 2), W ~ U(-0.5, 0.5): g and u have a spread of ~7, so both clamps bite. */
    sl_moe_expert_w w = random_expert(&r, types, dim, inter, 0.5f, 0.05f);
    uint16_t x[512], y[512];
    random_x(&r, x, dim, 2.0f);
    float g[256], u[256], h[256], yf[512];
    sl_moe_ref_trace tr = {g, u, h, yf};
    const float weight = 0.37f;
    sl_err err = {0};
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, x, weight, y, &tr, &err), 0, "%s",
                 err.msg);

    float *W1 = decode_all(types[0], w.gate, inter, dim);
    float *W3 = decode_all(types[1], w.up, inter, dim);
    float *W2 = decode_all(types[2], w.down, dim, inter);
    float xf[512], g_o[256], u_o[256], h_o[256], hh_o[256];
    for (uint32_t i = 0; i < dim; i++) xf[i] = sl_bf16_to_f32(x[i]);
    int clamped_g = 0, clamped_u = 0;
    for (uint32_t j = 0; j < inter; j++) {
        g_o[j] = bff((float)dot_down(W1 + (size_t)j * dim, xf, dim));
        u_o[j] = bff((float)dot_down(W3 + (size_t)j * dim, xf, dim));
        h_o[j] = oracle_h(g[j], u[j], 10.0f, weight);      /* from the reference's g, u */
        hh_o[j] = oracle_h(g_o[j], u_o[j], 10.0f, weight); /* the oracle's own chain */
        clamped_g += g[j] > 10.0f;
        clamped_u += fabsf(u[j]) > 10.0f;
    }
    cr_assert(clamped_g > 0 && clamped_u > 0, "the data should exercise the clamps (%d, %d)",
              clamped_g, clamped_u);
    expect_bf16_close(g, g_o, inter, "g");
    expect_bf16_close(u, u_o, inter, "u");
    expect_bf16_close(h, h_o, inter, "h");

    double num = 0, den = 0, max_err = 0, max_y = 0;
    for (uint32_t d = 0; d < dim; d++) {
        const double yd = dot_down(W2 + (size_t)d * inter, h, inter);
        cr_expect(fabs(yf[d] - yd) <= f32_ulp(yd), "y[%u] = %.9g, oracle %.12g", d, (double)yf[d],
                  yd);
        cr_expect_eq(y[d], bf(yf[d]), "y[%u]: the output is bf16(trace y)", d);
        const double ye = dot_down(W2 + (size_t)d * inter, hh_o, inter);
        const double e = sl_bf16_to_f32(y[d]) - ye;
        num += e * e;
        den += ye * ye;
        max_err = fmax(max_err, fabs(e));
        max_y = fmax(max_y, fabs(ye));
    }
    cr_expect(sqrt(num) <= 0x1p-8 * sqrt(den), "end to end: rms error %.3g of rms %.3g",
              sqrt(num / dim), sqrt(den / dim));
    cr_expect(max_err <= 0x1p-6 * max_y, "end to end: max error %.3g, max |y| %.3g", max_err,
              max_y);
    free(W1);
    free(W3);
    free(W2);
    free_expert(&w);
}

/* Diagonal BF16 expert, x = 1: g_j = a_j, u_j = b_j, y_j = h_j. */
Test(moe_ref_expert, clamps_each_side)
{
    enum { N = 256 };
    static const float ab[][2] = {
        {50, 3},       /* gate clamped to 10 */
        {-50, 3},      /* gate not clamped from below: silu(-50) is ~ -1e-20, not silu(-10) */
        {2, 50},       /* up clamped to 10 */
        {2, -50},      /* up clamped to -10 */
        {-50, -50},    /* gate free, up clamped */
        {50, 50},      /* both clamped */
        {10, 10},      /* at the limit */
        {-10, -10},    /* at minus the limit: nothing moves */
        {12, -12},     /* both */
        {9.5f, -9.5f}, /* inside: nothing moves */
        {-20, 20},     /* gate free (tiny silu), up clamped */
        {0, 7},        /* silu(0) = 0 */
        {1, 1},        /* plain */
        {-3, 7},       /* negative gate, no clamp */
        {1000, 0.5f},  /* gate clamped: 0.5 * silu(10) */
        {-1000, 0.5f}, /* silu(-1000) = -0 */
    };
    const uint32_t n_case = sizeof ab / sizeof ab[0];
    float a[N] = {0}, b[N] = {0}, c[N];
    for (uint32_t j = 0; j < N; j++) c[j] = 1.0f;
    for (uint32_t j = 0; j < n_case; j++) {
        a[j] = ab[j][0];
        b[j] = ab[j][1];
    }
    sl_moe_shape s = make_shape(N, N, 1, 1);
    set_all_types(&s, SL_QTYPE_BF16, 0);
    sl_moe_expert_w w = diag_expert(N, a, b, c);
    uint16_t x[N], y[N];
    for (uint32_t i = 0; i < N; i++) x[i] = bf(1.0f);
    float g[N], u[N], h[N];
    sl_moe_ref_trace tr = {g, u, h, NULL};
    const float weight = 0.75f;
    sl_err err = {0};
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, x, weight, y, &tr, &err), 0, "%s",
                 err.msg);
    for (uint32_t j = 0; j < N; j++) {
        cr_expect_eq(g[j], a[j], "g[%u] is the unclamped gate", j);
        cr_expect_eq(u[j], b[j], "u[%u] is the unclamped up", j);
        const double gc = fmin(a[j], 10.0), uc = fmax(fmin(b[j], 10.0), -10.0);
        const double want = weight * silu_d(gc) * uc;
        const float got = sl_bf16_to_f32(y[j]);
        /* -0 from silu(-1000) becomes +0 in the down projection's sum: compare zeros
         * as numbers, everything else with its sign. */
        const int sign_ok = want == 0 || (got < 0) == (want < 0);
        cr_expect(fabs(got - want) <= bf16_ulp((float)want) && sign_ok,
                  "case %u (g %g, u %g): y %.9g, want %.9g", j, (double)a[j], (double)b[j],
                  (double)got, want);
        cr_expect_eq(got, h[j], "y = h with an identity down projection");
    }
    /* The gate's lower side really is free: a two-sided clamp would give 2.25*silu(-10). */
    cr_expect(fabsf(sl_bf16_to_f32(y[1])) < 1e-18f, "y[1] = %g", (double)sl_bf16_to_f32(y[1]));

    /* swiglu_limit 0 means no clamp (the reference's `if swiglu_limit > 0`). */
    s.swiglu_limit = 0.0f;
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, x, 1.0f, y, NULL, &err), 0);
    cr_expect_eq(sl_bf16_to_f32(y[5]), bff((float)(50 * silu_d(50))), "unclamped 50, 50: %g",
                 (double)sl_bf16_to_f32(y[5]));
    free_expert(&w);
}

/* The weight multiplies h in f32 before its bf16 rounding and the down projection:
 * y = bf16(w * act), not bf16(w * bf16(act)). g = 33 makes silu exact in f32
 * (1 + expf(-33) == 1), and act = 33 * u is exact; only w * act rounds. */
Test(moe_ref_expert, weight_before_down_projection)
{
    enum { N = 256 };
    float a[N], b[N], c[N];
    for (uint32_t j = 0; j < N; j++) {
        a[j] = 33.0f;
        b[j] = (1.0f + (float)(j % 128) / 128.0f) * (j < 128 ? 1.0f : -4.0f); /* bf16-exact */
        c[j] = 1.0f;
    }
    sl_moe_shape s = make_shape(N, N, 1, 1);
    set_all_types(&s, SL_QTYPE_BF16, 0);
    s.swiglu_limit = 0.0f;
    sl_moe_expert_w w = diag_expert(N, a, b, c);
    uint16_t x[N], y[N];
    for (uint32_t i = 0; i < N; i++) x[i] = bf(1.0f);
    const float weight = 0.7f;
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, x, weight, y, NULL, NULL), 0);
    int differ = 0;
    for (uint32_t j = 0; j < N; j++) {
        const float act = 33.0f * b[j];
        const float before = bff(weight * act), after = bff(weight * bff(act));
        differ += before != after;
        cr_expect(same_bits(sl_bf16_to_f32(y[j]), before), "y[%u] = %.9g, want %.9g (after: %.9g)",
                  j, (double)sl_bf16_to_f32(y[j]), (double)before, (double)after);
    }
    cr_expect(differ > 10, "the case should separate the two orders (%d lanes differ)", differ);
    free_expert(&w);
}

Test(moe_ref_expert, shared_types_bf16)
{
    rng r = {77};
    const uint32_t dim = 256, inter = 512;
    sl_moe_shape s = make_shape(dim, inter, 1, 1);
    set_all_types(&s, SL_QTYPE_BF16, 1); /* routed stay Q2_K/Q2_K/Q3_K */
    const uint32_t t_bf[3] = {SL_QTYPE_BF16, SL_QTYPE_BF16, SL_QTYPE_BF16};
    sl_moe_expert_w sh = random_expert(&r, t_bf, dim, inter, 0.3f, 0.05f);
    uint16_t x[256], y[256];
    random_x(&r, x, dim, 1.0f);
    float g[512], u[512], h[512];
    sl_moe_ref_trace tr = {g, u, h, NULL};
    sl_err err = {0};
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_SHARED, &sh, x, 1.0f, y, &tr, &err), 0, "%s",
                 err.msg);
    float *W1 = decode_all(SL_QTYPE_BF16, sh.gate, inter, dim);
    float *W3 = decode_all(SL_QTYPE_BF16, sh.up, inter, dim);
    float *W2 = decode_all(SL_QTYPE_BF16, sh.down, dim, inter);
    float xf[256], g_o[512], u_o[512], h_o[512];
    for (uint32_t i = 0; i < dim; i++) xf[i] = sl_bf16_to_f32(x[i]);
    for (uint32_t j = 0; j < inter; j++) {
        g_o[j] = bff((float)dot_down(W1 + (size_t)j * dim, xf, dim));
        u_o[j] = bff((float)dot_down(W3 + (size_t)j * dim, xf, dim));
        h_o[j] = oracle_h(g[j], u[j], 10.0f, 1.0f);
    }
    expect_bf16_close(g, g_o, inter, "shared g");
    expect_bf16_close(u, u_o, inter, "shared u");
    expect_bf16_close(h, h_o, inter, "shared h");
    for (uint32_t d = 0; d < dim; d++) {
        const double yd = dot_down(W2 + (size_t)d * inter, h, inter);
        cr_expect_eq(y[d], bf((float)yd), "shared y[%u]", d);
    }
    /* And the routed kind reads the routed types: the same BF16 blocks give the same
     * output once the routed types say BF16 (and the shared ones say otherwise). */
    s.gate_type = s.up_type = s.down_type = SL_QTYPE_BF16;
    s.sh_gate_type = s.sh_up_type = s.sh_down_type = SL_QTYPE_F32;
    uint16_t y2[256];
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &sh, x, 1.0f, y2, NULL, &err), 0);
    cr_expect_eq(memcmp(y, y2, sizeof y), 0, "routed kind with routed types = BF16");
    free(W1);
    free(W3);
    free(W2);
    free_expert(&sh);
}

Test(moe_ref_expert, bad_arguments_refused)
{
    rng r = {5};
    const uint32_t types[3] = {SL_QTYPE_Q2_K, SL_QTYPE_Q2_K, SL_QTYPE_Q3_K};
    sl_moe_expert_w w = random_expert(&r, types, 256, 256, 0.1f, 0.1f);
    uint16_t x[512] = {0}, y[512];
    sl_err err = {0};
    sl_moe_shape s = make_shape(256, 256, 1, 1);
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, x, 1.0f, y, NULL, &err), 0);

    const uint32_t bad_dims[][2] = {{0, 256}, {300, 256}, {128, 256},
                                    {256, 0}, {256, 100}, {256, 384}};
    for (size_t i = 0; i < sizeof bad_dims / sizeof bad_dims[0]; i++) {
        sl_moe_shape b = make_shape(bad_dims[i][0], bad_dims[i][1], 1, 1);
        err.msg[0] = 0;
        cr_expect_eq(sl_moe_ref_expert(&b, SL_MOE_REF_ROUTED, &w, x, 1.0f, y, NULL, &err),
                     SL_EINVAL, "dim %u inter %u accepted", bad_dims[i][0], bad_dims[i][1]);
        cr_expect(strstr(err.msg, "dim") != NULL, "message '%s'", err.msg);
    }
    const uint32_t bad_types[] = {4, 5, SL_QTYPE_Q8_1, SL_QTYPE_I8, SL_QTYPE_F64, 31, 1000};
    for (size_t i = 0; i < sizeof bad_types / sizeof bad_types[0]; i++) {
        for (int which = 0; which < 3; which++) {
            sl_moe_shape b = s;
            uint32_t *t = which == 0 ? &b.gate_type : which == 1 ? &b.up_type : &b.down_type;
            *t = bad_types[i];
            cr_expect_eq(sl_moe_ref_expert(&b, SL_MOE_REF_ROUTED, &w, x, 1.0f, y, NULL, &err),
                         SL_EINVAL, "type %u accepted", bad_types[i]);
            cr_expect(strstr(err.msg, "type") != NULL, "message '%s'", err.msg);
        }
        sl_moe_shape b = s;
        b.sh_down_type = bad_types[i];
        cr_expect_eq(sl_moe_ref_expert(&b, SL_MOE_REF_SHARED, &w, x, 1.0f, y, NULL, &err),
                     SL_EINVAL, "shared type %u accepted", bad_types[i]);
    }
    sl_moe_shape b = s;
    b.swiglu_limit = -1.0f;
    cr_expect_eq(sl_moe_ref_expert(&b, SL_MOE_REF_ROUTED, &w, x, 1.0f, y, NULL, &err), SL_EINVAL);
    b.swiglu_limit = NAN;
    cr_expect_eq(sl_moe_ref_expert(&b, SL_MOE_REF_ROUTED, &w, x, 1.0f, y, NULL, &err), SL_EINVAL);
    cr_expect_eq(sl_moe_ref_expert(&s, (enum sl_moe_ref_kind)2, &w, x, 1.0f, y, NULL, &err),
                 SL_EINVAL);
    sl_moe_expert_w hole = w;
    hole.down = NULL;
    cr_expect_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &hole, x, 1.0f, y, NULL, &err),
                 SL_EINVAL);
    cr_expect_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, NULL, 1.0f, y, NULL, &err),
                 SL_EINVAL);
    cr_expect_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &w, x, 1.0f, NULL, NULL, &err),
                 SL_EINVAL);
    free_expert(&w);
}

/* ------------------------------------------------------------------ combine */

/* Experts' outputs are summed in increasing expert id, whatever the rank order, then
 * the shared expert. Expert 9's down projection is 2^20 times the others', so the f32
 * sums of the orders differ and the check can tell them apart. */
Test(moe_ref_apply, combine_in_expert_id_order_then_shared)
{
    rng r = {2024};
    const uint32_t dim = 256, inter = 256, n_expert = 12;
    sl_moe_shape s = make_shape(dim, inter, n_expert, 3);
    set_all_types(&s, SL_QTYPE_BF16, 0);
    const uint32_t t_bf[3] = {SL_QTYPE_BF16, SL_QTYPE_BF16, SL_QTYPE_BF16};
    const uint32_t t_sh[3] = {SL_QTYPE_Q2_K, SL_QTYPE_Q2_K, SL_QTYPE_Q3_K};
    sl_moe_expert_w ex[12] = {0};
    const uint32_t used[3] = {9, 2, 5}; /* by rank */
    for (int i = 0; i < 3; i++)
        ex[used[i]] = random_expert(&r, t_bf, dim, inter, 0.2f, used[i] == 9 ? 0x1p20f : 1.0f);
    sl_moe_expert_w sh = random_expert(&r, t_sh, dim, inter, 0.2f, 0.1f);
    uint16_t x[256], y[256], y_nosh[256], ye[3][256], ysh[256];
    float yf[256], yf_nosh[256];
    random_x(&r, x, dim, 1.0f);
    sl_moe_route rt = {{9, 2, 5}, {0.9f, 0.35f, 0.25f}};
    sl_err err = {0};
    cr_assert_eq(sl_moe_ref_apply(&s, ex, &sh, &rt, x, y, yf, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_moe_ref_apply(&s, ex, NULL, &rt, x, y_nosh, yf_nosh, &err), 0, "%s", err.msg);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_ROUTED, &ex[used[i]], x, rt.weight[i], ye[i],
                                       NULL, &err),
                     0);
    cr_assert_eq(sl_moe_ref_expert(&s, SL_MOE_REF_SHARED, &sh, x, 1.0f, ysh, NULL, &err), 0);
    int order_matters = 0;
    for (uint32_t d = 0; d < dim; d++) {
        float e2 = sl_bf16_to_f32(ye[1][d]), e5 = sl_bf16_to_f32(ye[2][d]),
              e9 = sl_bf16_to_f32(ye[0][d]), es = sl_bf16_to_f32(ysh[d]);
        const float by_id = ((0.0f + e2) + e5) + e9, by_rank = ((0.0f + e9) + e2) + e5;
        order_matters += !same_bits(by_id, by_rank);
        cr_expect(same_bits(yf_nosh[d], by_id), "[%u] routed sum %.9g, by id %.9g, by rank %.9g", d,
                  (double)yf_nosh[d], (double)by_id, (double)by_rank);
        cr_expect(same_bits(yf[d], by_id + es), "[%u] with shared %.9g, want %.9g", d,
                  (double)yf[d], (double)(by_id + es));
        cr_expect_eq(y[d], bf(yf[d]), "[%u] y is bf16 of the f32 sum", d);
        cr_expect_eq(y_nosh[d], bf(yf_nosh[d]));
    }
    cr_expect(order_matters > 0, "the data should make the order observable");
    int shared_seen = 0;
    for (uint32_t d = 0; d < dim; d++) shared_seen += yf[d] != yf_nosh[d];
    cr_expect(shared_seen > (int)dim / 2, "the shared expert changes the output (%d)", shared_seen);

    /* The rank order of the route does not matter, only the (expert, weight) pairs. */
    sl_moe_route perm = {{5, 9, 2}, {0.25f, 0.9f, 0.35f}};
    float yf_perm[256];
    uint16_t y_perm[256];
    cr_assert_eq(sl_moe_ref_apply(&s, ex, &sh, &perm, x, y_perm, yf_perm, &err), 0);
    cr_expect_eq(memcmp(yf, yf_perm, sizeof yf), 0);
    cr_expect_eq(memcmp(y, y_perm, sizeof y), 0);

    /* The routing weight follows its expert. */
    sl_moe_route swapped = {{9, 2, 5}, {0.9f, 0.25f, 0.35f}};
    cr_assert_eq(sl_moe_ref_apply(&s, ex, &sh, &swapped, x, y_perm, yf_perm, &err), 0);
    cr_expect_neq(memcmp(yf, yf_perm, sizeof yf), 0, "weights must follow their experts");

    for (int i = 0; i < 3; i++) free_expert(&ex[used[i]]);
    free_expert(&sh);
}

Test(moe_ref_apply, bad_routes_refused)
{
    rng r = {8};
    const uint32_t types[3] = {SL_QTYPE_Q2_K, SL_QTYPE_Q2_K, SL_QTYPE_Q3_K};
    sl_moe_expert_w ex[4];
    for (int e = 0; e < 4; e++) ex[e] = random_expert(&r, types, 256, 256, 0.1f, 0.1f);
    sl_moe_shape s = make_shape(256, 256, 4, 2);
    uint16_t x[256] = {0}, y[256];
    sl_err err = {0};
    sl_moe_route ok = {{3, 1}, {1, 1}}, dup = {{2, 2}, {1, 1}}, far = {{1, 4}, {1, 1}};
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &ok, x, y, NULL, &err), 0, "%s", err.msg);
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &dup, x, y, NULL, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "twice") != NULL, "message '%s'", err.msg);
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &far, x, y, NULL, &err), SL_EINVAL);
    s.n_used = 0;
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &ok, x, y, NULL, &err), SL_EINVAL);
    s.n_used = 5;
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &ok, x, y, NULL, &err), SL_EINVAL);
    s.n_used = 2;
    s.inter = 200;
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &ok, x, y, NULL, &err), SL_EINVAL);
    /* A bad type in the shared expert is reported as the shared expert's. */
    s.inter = 256;
    s.sh_up_type = 4;
    cr_expect_eq(sl_moe_ref_apply(&s, ex, &ex[0], &ok, x, y, NULL, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "shared") != NULL, "message '%s'", err.msg);
    for (int e = 0; e < 4; e++) free_expert(&ex[e]);
}

/* ------------------------------------------------------------------ layer */

typedef struct layer_fixture {
    sl_moe_shape s;
    sl_moe_expert_w ex[16];
    sl_moe_layer_w lw;
    uint16_t *router;
    float bias[16];
} layer_fixture;

static void layer_init(layer_fixture *f, rng *r)
{
    const uint32_t dim = 256, inter = 256, n_expert = 16;
    f->s = make_shape(dim, inter, n_expert, 6);
    const uint32_t types[3] = {SL_QTYPE_Q2_K, SL_QTYPE_Q2_K, SL_QTYPE_Q3_K};
    for (uint32_t e = 0; e < n_expert; e++)
        f->ex[e] = random_expert(r, types, dim, inter, 0.2f, 0.1f);
    f->router = malloc(sizeof(uint16_t) * n_expert * dim);
    random_x(r, f->router, n_expert * dim, 0.1f);
    for (uint32_t e = 0; e < n_expert; e++) f->bias[e] = 0.05f * rng_uniform(r);
    f->lw.router = f->router;
    f->lw.bias = f->bias;
    f->lw.shared = random_expert(r, types, dim, inter, 0.2f, 0.1f);
}

static void layer_free(layer_fixture *f)
{
    for (uint32_t e = 0; e < f->s.n_expert; e++) free_expert(&f->ex[e]);
    free_expert(&f->lw.shared);
    free(f->router);
}

Test(moe_ref_layer, routes_then_applies_deterministically)
{
    rng r = {0xfeed};
    layer_fixture f;
    layer_init(&f, &r);
    uint16_t x[256], y[256], y2[256], y3[256];
    float yf[256], yf2[256], logits[16];
    random_x(&r, x, 256, 1.5f);
    sl_moe_route rt, rt_direct;
    sl_err err = {0};
    cr_assert_eq(sl_moe_ref_layer(&f.s, &f.lw, f.ex, x, y, yf, &rt, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_router_route(x, &f.lw, &f.s, logits, &rt_direct, &err), 0);
    cr_expect_eq(memcmp(&rt, &rt_direct, sizeof rt), 0, "the layer uses the router's decision");
    cr_assert_eq(sl_moe_ref_apply(&f.s, f.ex, &f.lw.shared, &rt_direct, x, y2, NULL, &err), 0);
    cr_expect_eq(memcmp(y, y2, sizeof y), 0);
    double wsum = 0;
    for (int k = 0; k < 6; k++) wsum += rt.weight[k];
    cr_expect(fabs(wsum - 1.5) < 1e-5, "routing weights sum to %.9g", wsum);

    /* Same input, same bytes; y_f32 is optional. */
    cr_assert_eq(sl_moe_ref_layer(&f.s, &f.lw, f.ex, x, y3, yf2, NULL, &err), 0);
    cr_expect_eq(memcmp(y, y3, sizeof y), 0);
    cr_expect_eq(memcmp(yf, yf2, sizeof yf), 0);
    cr_assert_eq(sl_moe_ref_layer(&f.s, &f.lw, f.ex, x, y3, NULL, NULL, &err), 0);
    cr_expect_eq(memcmp(y, y3, sizeof y), 0);

    /* Not a constant function: another input routes and sums differently. */
    uint16_t x2[256];
    random_x(&r, x2, 256, 1.5f);
    cr_assert_eq(sl_moe_ref_layer(&f.s, &f.lw, f.ex, x2, y3, NULL, NULL, &err), 0);
    cr_expect_neq(memcmp(y, y3, sizeof y), 0);

    /* A missing shared expert is an error for the layer. */
    sl_moe_layer_w no_sh = f.lw;
    no_sh.shared.up = NULL;
    cr_expect_eq(sl_moe_ref_layer(&f.s, &no_sh, f.ex, x, y3, NULL, NULL, &err), SL_EINVAL);
    layer_free(&f);
}
