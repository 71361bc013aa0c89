/* test_router.c - the MoE gate: the lane/butterfly order of the logits (against an
 * emulation written here, lane by lane, and against a double dot product), the
 * sqrt-softplus score, the top-k order with its tie rule, and the routing weights.
 *
 * Tolerances. Logits vs the emulation: bit-exact (the order is the contract with
 * the GPU kernel). Logits vs the double dot product: each lane adds dim/32 terms and
 * the butterfly 5 more, so the f32 result is within (dim/32 + 5) * 2^-24 * sum|x_i w_i|
 * (the classic recursive-summation bound; bf16 x bf16 products are exact in f32).
 * Scores vs libm's double functions: one f32 ulp (score.h computes in double and
 * rounds once).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "quant.h"
#include "moe_emu.h"
#include "router.h"
#include "score.h"

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

static float ulp_of(float v)
{
    v = fabsf(v);
    return nextafterf(v, INFINITY) - v;
}

static sl_moe_shape shape(uint32_t n_expert, uint32_t n_used, int norm, float scale)
{
    sl_moe_shape s;
    memset(&s, 0, sizeof s);
    s.dim = 256;
    s.n_expert = n_expert;
    s.n_used = n_used;
    s.norm_topk = norm;
    s.route_scale = scale;
    s.gate_temp = 1.0f;
    return s;
}

static void fill_bf16(rng *r, uint16_t *v, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++) v[i] = bf(amp * rng_uniform(r));
}

/* The lane order written out literally: 32 lane accumulators, each walking the
 * elements it owns, then a butterfly where every lane reads the old value of its
 * partner (a snapshot), as 32 GPU threads exchanging through shuffles would. */
static float emulate_logit(const uint16_t *x, const uint16_t *w, uint32_t dim)
{
    float lane[32];
    for (int l = 0; l < 32; l++) {
        float acc = 0.0f;
        for (uint32_t i = 0; i < dim; i++)
            if ((i / 8) % 32 == (uint32_t)l)
                acc = fmaf(sl_bf16_to_f32(x[i]), sl_bf16_to_f32(w[i]), acc);
        lane[l] = acc;
    }
    for (int off = 16; off >= 1; off /= 2) {
        float old[32];
        memcpy(old, lane, sizeof old);
        for (int l = 0; l < 32; l++) lane[l] = old[l] + old[l ^ off];
    }
    for (int l = 1; l < 32; l++)
        cr_assert(memcmp(&lane[l], &lane[0], sizeof(float)) == 0, "lane %d ends unlike lane 0", l);
    return lane[0];
}

static int same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* ------------------------------------------------------------------ logits */

Test(router_logits, lane_order_bit_exact)
{
    rng r = {0x9e3779b97f4a7c15ull};
    const uint32_t dims[] = {256, 512, 1280, 5120};
    const uint32_t n_expert = 24;
    for (size_t t = 0; t < sizeof dims / sizeof dims[0]; t++) {
        const uint32_t dim = dims[t];
        uint16_t *x = malloc(dim * sizeof *x), *w = malloc((size_t)n_expert * dim * sizeof *w);
        float logits[24], scaled[24];
        fill_bf16(&r, x, dim, 4.0f);
        fill_bf16(&r, w, (size_t)n_expert * dim, 0.05f);
        sl_err err = {0};
        cr_assert_eq(sl_router_logits(x, w, n_expert, dim, 1.0f, logits, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_router_logits(x, w, n_expert, dim, 0.7f, scaled, &err), 0, "%s", err.msg);
        for (uint32_t e = 0; e < n_expert; e++) {
            const float want = emulate_logit(x, w + (size_t)e * dim, dim);
            cr_expect(same_bits(logits[e], want), "dim %u expert %u: %.9g, emulation %.9g", dim, e,
                      (double)logits[e], (double)want);
            cr_expect(same_bits(scaled[e], want / 0.7f), "dim %u expert %u: gate_temp 0.7", dim, e);
        }
        free(x);
        free(w);
    }
}

Test(router_logits, near_double_dot)
{
    rng r = {12345};
    const uint32_t dim = 5120, n_expert = 64;
    uint16_t *x = malloc(dim * sizeof *x), *w = malloc((size_t)n_expert * dim * sizeof *w);
    float logits[64];
    fill_bf16(&r, x, dim, 3.0f);
    fill_bf16(&r, w, (size_t)n_expert * dim, 0.02f);
    cr_assert_eq(sl_router_logits(x, w, n_expert, dim, 1.0f, logits, NULL), 0);
    for (uint32_t e = 0; e < n_expert; e++) {
        double dot = 0, mag = 0;
        for (uint32_t i = 0; i < dim; i++) {
            const double p = (double)sl_bf16_to_f32(x[i]) * sl_bf16_to_f32(w[(size_t)e * dim + i]);
            dot += p;
            mag += fabs(p);
        }
        const double tol = (dim / 32 + 5) * 0x1p-24 * mag;
        cr_expect(fabs(logits[e] - dot) <= tol, "expert %u: %.9g vs double %.12g (tol %.3g)", e,
                  (double)logits[e], dot, tol);
    }
    free(x);
    free(w);
}

/* The order is observable: a value chosen so that the lane order and a plain
 * left-to-right f32 sum disagree. 2^24 sits in lane 0; ones in lanes 1 and 17 meet
 * at butterfly step 16 (1 + 1 = 2) before joining 2^24 (exact: 2^24 + 2), whereas a
 * sequential sum loses each 1 to rounding (2^24 + 1 rounds to even, 2^24). */
Test(router_logits, order_is_observable)
{
    uint16_t x[256], w[256];
    for (int i = 0; i < 256; i++) x[i] = w[i] = 0;
    x[0] = bf(16777216.0f);
    x[8] = bf(1.0f);   /* lane 1 */
    x[136] = bf(1.0f); /* lane 17 */
    for (int i = 0; i < 256; i++) w[i] = bf(1.0f);
    float logit, seq = 0.0f;
    cr_assert_eq(sl_router_logits(x, w, 1, 256, 1.0f, &logit, NULL), 0);
    for (int i = 0; i < 256; i++) seq = fmaf(sl_bf16_to_f32(x[i]), 1.0f, seq);
    cr_expect_eq(logit, 16777218.0f, "lane order gives %.9g", (double)logit);
    cr_expect_eq(seq, 16777216.0f, "the sequential sum should lose the ones (%.9g)", (double)seq);

    /* On random data, the sequential order differs for some experts too: the
     * bit-exact comparison with the emulation above can tell orders apart. */
    rng r = {777};
    const uint32_t dim = 2048, n_expert = 64;
    uint16_t *xr = malloc(dim * sizeof *xr), *wr = malloc((size_t)n_expert * dim * sizeof *wr);
    float logits[64];
    fill_bf16(&r, xr, dim, 1.0f);
    fill_bf16(&r, wr, (size_t)n_expert * dim, 1.0f);
    cr_assert_eq(sl_router_logits(xr, wr, n_expert, dim, 1.0f, logits, NULL), 0);
    int differ = 0;
    for (uint32_t e = 0; e < n_expert; e++) {
        float acc = 0.0f;
        for (uint32_t i = 0; i < dim; i++)
            acc = fmaf(sl_bf16_to_f32(xr[i]), sl_bf16_to_f32(wr[(size_t)e * dim + i]), acc);
        differ += !same_bits(acc, logits[e]);
    }
    cr_expect(differ > 0, "sequential and lane order agree on all %u experts", n_expert);
    free(xr);
    free(wr);
}

Test(router_logits, bad_arguments_refused)
{
    static uint16_t x[5120 + 256], w[4 * (5120 + 256)];
    float logits[4] = {0};
    sl_err err = {0};
    const uint32_t bad_dims[] = {0, 8, 128, 255, 257, 300, 5120 + 8, 5120 - 128};
    for (size_t i = 0; i < sizeof bad_dims / sizeof bad_dims[0]; i++) {
        err.msg[0] = 0;
        cr_expect_eq(sl_router_logits(x, w, 4, bad_dims[i], 1.0f, logits, &err), SL_EINVAL,
                     "dim %u accepted", bad_dims[i]);
        cr_expect(strstr(err.msg, "dim") != NULL, "message for dim %u: '%s'", bad_dims[i], err.msg);
    }
    cr_expect_eq(sl_router_logits(x, w, 4, 5120 + 256, 1.0f, logits, &err), 0, "%s", err.msg);
    cr_expect_eq(sl_router_logits(x, w, 0, 256, 1.0f, logits, &err), SL_EINVAL);
    const float bad_temp[] = {0.0f, -1.0f, NAN, INFINITY};
    for (size_t i = 0; i < 4; i++)
        cr_expect_eq(sl_router_logits(x, w, 4, 256, bad_temp[i], logits, &err), SL_EINVAL,
                     "gate_temp %g accepted", (double)bad_temp[i]);
    cr_expect_eq(sl_router_logits(NULL, w, 4, 256, 1.0f, logits, &err), SL_EINVAL);
    cr_expect_eq(sl_router_logits(x, NULL, 4, 256, 1.0f, logits, &err), SL_EINVAL);
    cr_expect_eq(sl_router_logits(x, w, 4, 256, 1.0f, NULL, &err), SL_EINVAL);
}

/* ------------------------------------------------------------------ scores */

Test(router_score, sqrt_softplus)
{
    /* Above 20 the shortcut: softplus(v) = v exactly, so perfect squares stay exact. */
    cr_expect_eq(sl_router_score(25.0f), 5.0f);
    cr_expect_eq(sl_router_score(400.0f), 20.0f);
    cr_expect_eq(sl_router_score(20.5f), sqrtf(20.5f));
    cr_expect_eq(sl_router_score(1e30f), sqrtf(1e30f));
    cr_expect_eq(sl_router_score(3.0e38f), sqrtf(3.0e38f));
    cr_expect(isinf(sl_router_score(INFINITY)) && sl_router_score(INFINITY) > 0);
    cr_expect(isnan(sl_router_score(NAN)));
    cr_expect_eq(sl_router_score(-INFINITY), 0.0f);
    cr_expect_eq(sl_router_score(-1000.0f), 0.0f); /* expf underflows to 0 */

    /* softplus(-100) = e^-100 is computed in double (a normal number there), so the
     * score e^-50 is as exact as any other. */
    const float tiny = sl_router_score(-100.0f);
    cr_expect(fabs(tiny - exp(-50.0)) <= ulp_of((float)exp(-50.0)), "score(-100) = %g, want %g",
              (double)tiny, exp(-50.0));

    /* Sweeps against libm's double functions (each within an ulp of a double): the
     * score is computed in double and rounded once, so it is the correctly rounded f32
     * or one ulp from it, over the whole range where softplus is not the identity. */
    for (float v = -120.0f; v <= 30.0f; v += 1.0f / 64) {
        const double want = sqrt(v > 20.0f ? (double)v : log1p(exp((double)v)));
        const float got = sl_router_score(v);
        cr_expect(fabs(got - want) <= ulp_of((float)want), "score(%g) = %.9g, want %.12g",
                  (double)v, (double)got, want);
    }
    rng r = {0x5eed5c0eull};
    for (int i = 0; i < 200000; i++) {
        const float v = (float)(rng_uniform(&r) * 380.0 - 360.0); /* [-740, 20) */
        const double want = sqrt(log1p(exp((double)v)));
        const float got = sl_router_score(v);
        cr_expect(fabs(got - want) <= ulp_of((float)want), "score(%.9g) = %.9g, want %.12g",
                  (double)v, (double)got, want);
    }
}

/* score.h's log1p table: c_i of 12 significant bits (so that c_i - 1 and c_i t stay
 * exact enough), its interval [i/64, (i + 1)/64] mapped within 2^-7 of 1 (2^-6 for
 * i = 0), L_i = -ln c_i within an ulp of libm's; and the score near 0, where the table
 * decides, densely against libm. */
Test(router_score, log1p_table)
{
    const double(*tab)[2] = sl_score_tab_host; /* the table sl_router_score reads */
    cr_assert(tab[0][0] == 1.0 && tab[0][1] == 0.0);
    for (int i = 0; i < SL_SCORE_TAB_N; i++) {
        const double c = tab[i][0];
        int e;
        const double m = frexp(c, &e) * 4096.0; /* 12 bits: an integer */
        cr_expect(m == floor(m) && c > 0.5 && c <= 1.0, "c_%d = %.17g", i, c);
        const double lim = i ? 0x1p-7 : 0x1p-6;
        for (int end = 0; end < 2; end++) {
            const double t = (double)(i + end) / SL_SCORE_TAB_N;
            cr_expect(fabs(c * (1.0 + t) - 1.0) <= lim, "c_%d maps t = %g to %g", i, t,
                      c * (1.0 + t));
        }
        const double want = -log(c);
        cr_expect(fabs(tab[i][1] - want) <= nextafter(want, 1.0) - want, "L_%d = %.17g, want %.17g",
                  i, tab[i][1], want);
    }
    rng r = {0x10917ab1eull};
    for (int i = 0; i < 400000; i++) {
        const float v = (float)(rng_uniform(&r) * 12.0); /* [-12, 12) */
        const double want = sqrt(log1p(exp((double)v)));
        const float got = sl_router_score(v);
        cr_expect(fabs(got - want) <= ulp_of((float)want), "score(%.9g) = %.9g, want %.12g",
                  (double)v, (double)got, want);
    }
}

/* ------------------------------------------------------------------ selection */

static void expect_experts(const sl_moe_route *rt, const uint32_t *want, uint32_t k,
                           const char *what)
{
    for (uint32_t r = 0; r < k; r++)
        cr_expect_eq(rt->expert[r], want[r], "%s: rank %u is expert %u, want %u", what, r,
                     rt->expert[r], want[r]);
}

Test(router_select, exact_ties_lower_index_first)
{
    float logits[16], bias[16] = {0};
    for (int e = 0; e < 16; e++) logits[e] = 0.5f;
    sl_moe_shape s = shape(16, 6, 1, 1.5f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t all[] = {0, 1, 2, 3, 4, 5};
    expect_experts(&rt, all, 6, "all equal");
    for (int r = 0; r < 6; r++)
        cr_expect_eq(rt.weight[r], rt.weight[0], "equal scores get equal weights");

    /* Scattered equal maxima, then equal seconds. */
    for (int e = 0; e < 16; e++) logits[e] = -1.0f;
    logits[12] = logits[3] = logits[9] = 2.0f;
    logits[15] = logits[5] = 1.0f;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want[] = {3, 9, 12, 5, 15, 0};
    expect_experts(&rt, want, 6, "scattered ties");
}

Test(router_select, near_ties_one_ulp)
{
    float logits[8], bias[8] = {0};
    for (int e = 0; e < 8; e++) logits[e] = -5.0f;
    /* Keys one ulp apart through the bias: the higher index has the larger key. */
    logits[2] = logits[6] = 1.0f;
    const float sc = sl_router_score(1.0f);
    bias[6] = nextafterf(sc, INFINITY) - sc; /* exact (Sterbenz) */
    cr_assert(sc + bias[6] == nextafterf(sc, INFINITY));
    sl_moe_shape s = shape(8, 2, 1, 1.0f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want_b[] = {6, 2};
    expect_experts(&rt, want_b, 2, "bias one ulp");
    cr_expect_eq(rt.weight[0], rt.weight[1], "the bias must not reach the weights");

    /* Scores one ulp apart through the logits. */
    memset(bias, 0, sizeof bias);
    const float base = 0.75f, sb = sl_router_score(base);
    float up = base;
    while (sl_router_score(up) == sb) up = nextafterf(up, INFINITY);
    cr_assert(sl_router_score(up) == nextafterf(sb, INFINITY), "no one-ulp score step found");
    logits[1] = base;
    logits[7] = up;
    logits[2] = logits[6] = -5.0f;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want_s[] = {7, 1};
    expect_experts(&rt, want_s, 2, "score one ulp");
}

/* Exact numbers: logits above 20 give sqrt(logit), so 25 -> 5 and 36 -> 6. */
Test(router_select, tie_between_biased_and_unbiased)
{
    float logits[8], bias[8] = {0};
    for (int e = 0; e < 8; e++) logits[e] = 0.0f;
    logits[5] = 36.0f; /* key 6 + 0 */
    logits[2] = 25.0f; /* key 5 + 1 */
    bias[2] = 1.0f;
    sl_moe_shape s = shape(8, 2, 1, 1.5f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want[] = {2, 5};
    expect_experts(&rt, want, 2, "biased/unbiased tie");
    const float denom = 11.0f + 1e-20f;
    cr_expect_eq(rt.weight[0], 5.0f / denom * 1.5f, "weight %.9g", (double)rt.weight[0]);
    cr_expect_eq(rt.weight[1], 6.0f / denom * 1.5f, "weight %.9g", (double)rt.weight[1]);

    s.norm_topk = 0;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    cr_expect_eq(rt.weight[0], 7.5f);
    cr_expect_eq(rt.weight[1], 9.0f);
}

Test(router_select, bias_selects_but_does_not_weight)
{
    float logits[16], bias[16] = {0};
    for (int e = 0; e < 16; e++) logits[e] = 36.0f - e; /* scores decrease with e */
    logits[11] = 25.0f;                                 /* score 5, the lowest */
    bias[11] = 100.0f;
    sl_moe_shape s = shape(16, 3, 1, 1.5f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want[] = {11, 0, 1};
    expect_experts(&rt, want, 3, "biased pick");
    const double s0 = 5, s1 = 6, s2 = sqrt(35.0);
    const double sum = s0 + s1 + s2;
    cr_expect(fabs(rt.weight[0] - s0 / sum * 1.5) < 1e-6, "w0 %.9g", (double)rt.weight[0]);
    cr_expect(fabs(rt.weight[1] - s1 / sum * 1.5) < 1e-6, "w1 %.9g", (double)rt.weight[1]);
    cr_expect(fabs(rt.weight[2] - s2 / sum * 1.5) < 1e-6, "w2 %.9g", (double)rt.weight[2]);

    /* A negative bias drops the best score out. */
    memset(bias, 0, sizeof bias);
    bias[0] = -10.0f;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want2[] = {1, 2, 3};
    expect_experts(&rt, want2, 3, "negative bias");

    /* NULL bias is no bias. */
    cr_assert_eq(sl_router_select(logits, NULL, &s, &rt, NULL), 0);
    const uint32_t want3[] = {0, 1, 2};
    expect_experts(&rt, want3, 3, "no bias");
}

Test(router_select, huge_logits)
{
    float logits[8] = {0.5f, 21.0f, 1e30f, -3.0f, 100.0f, 1e30f, 0.0f, 19.0f};
    sl_moe_shape s = shape(8, 4, 0, 2.0f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, NULL, &s, &rt, NULL), 0);
    const uint32_t want[] = {2, 5, 4, 1};
    expect_experts(&rt, want, 4, "huge");
    cr_expect_eq(rt.weight[0], sqrtf(1e30f) * 2.0f);
    cr_expect_eq(rt.weight[2], 20.0f);
    cr_expect_eq(rt.weight[3], sqrtf(21.0f) * 2.0f);

    /* Normalised with 1e30 logits: finite, sum to the scale. */
    s.norm_topk = 1;
    cr_assert_eq(sl_router_select(logits, NULL, &s, &rt, NULL), 0);
    double sum = 0;
    for (int r = 0; r < 4; r++) sum += rt.weight[r];
    cr_expect(fabs(sum - 2.0) < 1e-5, "sum %.9g", sum);

    /* inf: ranks first; its weight is inf unnormalised and NaN normalised (inf/inf),
     * as the reference computes it. */
    logits[6] = INFINITY;
    s.norm_topk = 0;
    cr_assert_eq(sl_router_select(logits, NULL, &s, &rt, NULL), 0);
    cr_expect_eq(rt.expert[0], 6);
    cr_expect(isinf(rt.weight[0]));
    cr_expect_eq(rt.expert[1], 2);
    s.norm_topk = 1;
    cr_assert_eq(sl_router_select(logits, NULL, &s, &rt, NULL), 0);
    cr_expect_eq(rt.expert[0], 6);
    cr_expect(isnan(rt.weight[0]));
}

Test(router_select, tiny_and_negative_logits)
{
    float logits[6] = {-100.0f, -90.0f, -1000.0f, -2000.0f, -80.0f, -INFINITY};
    sl_moe_shape s = shape(6, 3, 1, 1.5f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, NULL, &s, &rt, NULL), 0);
    const uint32_t want[] = {4, 1, 0};
    expect_experts(&rt, want, 3, "tiny");
    for (int r = 0; r < 3; r++)
        cr_expect(rt.weight[r] > 0.0f && isfinite(rt.weight[r]), "weight %d = %g", r,
                  (double)rt.weight[r]);
    cr_expect(rt.weight[0] > rt.weight[1] && rt.weight[1] > rt.weight[2]);

    /* All scores exactly 0: the 1e-20 guard keeps the weights 0 rather than NaN, and
     * the ties go to the lower indices. */
    float zeros[6] = {-1000.0f, -1000.0f, -1000.0f, -2000.0f, -1e30f, -INFINITY};
    cr_assert_eq(sl_router_select(zeros, NULL, &s, &rt, NULL), 0);
    const uint32_t want_z[] = {0, 1, 2};
    expect_experts(&rt, want_z, 3, "zero scores");
    for (int r = 0; r < 3; r++) cr_expect_eq(rt.weight[r], 0.0f, "weight %d", r);
}

Test(router_select, nan_keys_rank_as_minus_inf)
{
    float logits[8] = {NAN, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 0.0f};
    float bias[8] = {0};
    sl_moe_shape s = shape(8, 7, 0, 1.0f);
    sl_moe_route rt;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want[] = {6, 5, 4, 3, 2, 1, 7};
    expect_experts(&rt, want, 7, "NaN logit last");

    /* A NaN key and a -inf key tie: the lower index first. */
    bias[1] = -INFINITY;
    bias[3] = NAN;
    s.n_used = 8;
    cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
    const uint32_t want2[] = {6, 5, 4, 2, 7, 0, 1, 3};
    expect_experts(&rt, want2, 8, "NaN and -inf keys");
}

Test(router_select, weights_normalised_and_scaled)
{
    rng r = {4242};
    float logits[384], bias[384];
    for (int t = 0; t < 50; t++) {
        for (int e = 0; e < 384; e++) {
            logits[e] = 6.0f * rng_uniform(&r);
            bias[e] = 0.1f * rng_uniform(&r);
        }
        const float scale = t % 2 ? 1.5f : 0.25f + (float)t;
        sl_moe_shape s = shape(384, 6, 1, scale);
        sl_moe_route on, off;
        cr_assert_eq(sl_router_select(logits, bias, &s, &on, NULL), 0);
        s.norm_topk = 0;
        cr_assert_eq(sl_router_select(logits, bias, &s, &off, NULL), 0);
        double sum_on = 0, sum_sc = 0;
        for (int k = 0; k < 6; k++) {
            cr_expect_eq(on.expert[k], off.expert[k], "norm_topk must not change the picks");
            const double sc = sl_router_score(logits[on.expert[k]]);
            sum_on += on.weight[k];
            sum_sc += sc;
            cr_expect(fabs(off.weight[k] - sc * scale) <= 2 * ulp_of(off.weight[k]),
                      "unnormalised weight %.9g, want %.9g", (double)off.weight[k], sc * scale);
        }
        for (int k = 0; k < 6; k++) {
            const double want = sl_router_score(logits[on.expert[k]]) / sum_sc * scale;
            cr_expect(fabs(on.weight[k] - want) <= 8 * ulp_of((float)want),
                      "normalised weight %.9g, want %.9g", (double)on.weight[k], want);
        }
        cr_expect(fabs(sum_on - scale) <= 2e-6 * scale, "weights sum to %.9g, want %g", sum_on,
                  (double)scale);
    }
}

/* Total order (key descending, index ascending) by qsort, as an oracle. */
typedef struct keyed {
    float key;
    uint32_t idx;
} keyed;

static int cmp_keyed(const void *a, const void *b)
{
    const keyed *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

Test(router_select, matches_sorted_oracle)
{
    rng r = {99};
    static float logits[384], bias[384];
    static keyed ks[384];
    const uint32_t sizes[] = {8, 16, 64, 384};
    for (int t = 0; t < 400; t++) {
        const uint32_t n = sizes[t % 4];
        const uint32_t cap = n < 64 ? n : 64;
        const uint32_t k = 1 + (uint32_t)(rng_next(&r) % cap);
        /* Few distinct values so that ties are frequent. */
        for (uint32_t e = 0; e < n; e++) {
            logits[e] = (float)(int)(rng_next(&r) % 7) - 3.0f;
            bias[e] = t % 3 ? 0.25f * (float)(int)(rng_next(&r) % 3) : 0.0f;
        }
        sl_moe_shape s = shape(n, k, t % 2, 1.5f);
        sl_moe_route rt;
        memset(&rt, 0xab, sizeof rt);
        cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
        for (uint32_t e = 0; e < n; e++) {
            ks[e].key = sl_router_score(logits[e]) + bias[e];
            ks[e].idx = e;
        }
        qsort(ks, n, sizeof ks[0], cmp_keyed);
        for (uint32_t i = 0; i < k; i++)
            cr_assert_eq(rt.expert[i], ks[i].idx, "trial %d (n %u k %u): rank %u is %u, want %u", t,
                         n, k, i, rt.expert[i], ks[i].idx);
        for (uint32_t i = k; i < SL_ROUTER_MAX_USED; i++)
            cr_assert(rt.expert[i] == 0 && rt.weight[i] == 0.0f, "entry %u past n_used not zero",
                      i);
    }
}

Test(router_select, bad_shapes_refused)
{
    float logits[8] = {0};
    sl_moe_route rt, before;
    memset(&rt, 0x5a, sizeof rt);
    before = rt;
    sl_err err = {0};
    sl_moe_shape s = shape(8, 0, 1, 1.5f);
    cr_expect_eq(sl_router_select(logits, NULL, &s, &rt, &err), SL_EINVAL);
    cr_expect(strstr(err.msg, "n_used") != NULL, "message '%s'", err.msg);
    s.n_used = 9;
    cr_expect_eq(sl_router_select(logits, NULL, &s, &rt, &err), SL_EINVAL);
    static float many[128];
    s = shape(128, 65, 1, 1.5f);
    cr_expect_eq(sl_router_select(many, NULL, &s, &rt, &err), SL_EINVAL);
    s.n_used = 64;
    cr_expect_eq(memcmp(&rt, &before, sizeof rt), 0, "out changed by a refused call");
    cr_expect_eq(sl_router_select(many, NULL, &s, &rt, &err), 0, "%s", err.msg);
    cr_expect_eq(sl_router_select(NULL, NULL, &s, &rt, &err), SL_EINVAL);
    cr_expect_eq(sl_router_select(many, NULL, NULL, &rt, &err), SL_EINVAL);
    cr_expect_eq(sl_router_select(many, NULL, &s, NULL, &err), SL_EINVAL);
}

Test(router_route, logits_then_select)
{
    rng r = {31337};
    const uint32_t dim = 512, n_expert = 32;
    uint16_t x[512], *w = malloc((size_t)n_expert * dim * sizeof *w);
    float bias[32], logits[32], logits2[32];
    fill_bf16(&r, x, dim, 2.0f);
    fill_bf16(&r, w, (size_t)n_expert * dim, 0.1f);
    for (uint32_t e = 0; e < n_expert; e++) bias[e] = 0.05f * rng_uniform(&r);
    sl_moe_shape s = shape(n_expert, 6, 1, 1.5f);
    s.dim = dim;
    s.gate_temp = 1.25f;
    sl_moe_layer_w lw = {.router = w, .bias = bias};
    sl_moe_route a, b;
    sl_err err = {0};
    cr_assert_eq(sl_router_route(x, &lw, &s, logits, &a, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_router_logits(x, w, n_expert, dim, 1.25f, logits2, &err), 0);
    cr_assert_eq(sl_router_select(logits2, bias, &s, &b, &err), 0);
    cr_expect_eq(memcmp(logits, logits2, sizeof logits), 0);
    cr_expect_eq(memcmp(&a, &b, sizeof a), 0);
    s.dim = 500;
    cr_expect_eq(sl_router_route(x, &lw, &s, logits, &a, &err), SL_EINVAL);
    free(w);
}

/* The router of router/ and the emulation of the GPU router GEMV (compute/moe_emu.h)
 * implement the same documented order: they must agree to the bit, so that the CPU
 * path and the GPU path of the engine route every token alike. */
Test(router_cross, router_equals_the_gpu_emulation_bit_for_bit)
{
    const uint32_t n_expert = 48, dim = 1024;
    uint16_t *w = malloc(sizeof(uint16_t) * n_expert * dim), *x = malloc(sizeof(uint16_t) * dim);
    float *a = malloc(sizeof(float) * n_expert), *b = malloc(sizeof(float) * n_expert);
    uint64_t s = 0x5eed;
    for (int round = 0; round < 20; round++) {
        for (uint32_t i = 0; i < n_expert * dim; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            w[i] = sl_f32_to_bf16(((float)(int32_t)(s >> 32) / 2147483648.0f) * 0.05f);
        }
        for (uint32_t i = 0; i < dim; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = sl_f32_to_bf16(((float)(int32_t)(s >> 32) / 2147483648.0f) * (round + 1));
        }
        float temp = round % 2 ? 1.0f : 0.75f;
        sl_err err = {0};
        cr_assert_eq(sl_router_logits(x, w, n_expert, dim, temp, a, &err), 0, "%s", err.msg);
        sl_emu_router_logits(w, x, n_expert, dim, temp, b);
        for (uint32_t e = 0; e < n_expert; e++)
            cr_assert(memcmp(&a[e], &b[e], sizeof(float)) == 0,
                      "round %d expert %u: router %.9g, GPU emulation %.9g", round, e, a[e], b[e]);
    }
    free(w);
    free(x);
    free(a);
    free(b);
}

/* The selection skips experts whose key certainly falls below the k-th kept one
 * without computing their score: against every score computed, with continuous
 * logits over a wide range and biases that put keys just above, at and just below the
 * threshold. */
Test(router_select, shortcut_changes_nothing)
{
    rng r = {4242};
    static float logits[384], bias[384];
    static keyed ks[384];
    for (int t = 0; t < 3000; t++) {
        const uint32_t n = 384, k = 1 + (uint32_t)(rng_next(&r) % 8);
        const float span = t % 3 == 0 ? 40.0f : t % 3 == 1 ? 4.0f : 0.01f;
        for (uint32_t e = 0; e < n; e++) {
            logits[e] = ((float)(rng_next(&r) % 2000001) / 1000000.0f - 1.0f) * span;
            bias[e] = t % 2 ? ((float)(rng_next(&r) % 2001) / 1000.0f - 1.0f) * 0.5f : 0.0f;
        }
        /* Near-ties with the would-be k-th key: copy keys across experts, nudged. */
        for (uint32_t e = 0; e < n; e++) {
            ks[e].key = sl_router_score(logits[e]) + bias[e];
            ks[e].idx = e;
        }
        qsort(ks, n, sizeof ks[0], cmp_keyed);
        float kth = ks[k - 1].key;
        for (uint32_t j = 0; j < 6; j++) {
            uint32_t e = (uint32_t)(rng_next(&r) % n);
            float sc = sl_router_score(logits[e]);
            int ulps = (int)(rng_next(&r) % 5) - 2;
            bias[e] = kth - sc;
            uint32_t u;
            memcpy(&u, &bias[e], 4);
            u = (uint32_t)((int32_t)u + ulps);
            memcpy(&bias[e], &u, 4);
        }
        sl_moe_shape s = shape(n, k, 1, 2.5f);
        sl_moe_route rt;
        cr_assert_eq(sl_router_select(logits, bias, &s, &rt, NULL), 0);
        float score[384];
        for (uint32_t e = 0; e < n; e++) {
            score[e] = sl_router_score(logits[e]);
            ks[e].key = score[e] + bias[e];
            ks[e].idx = e;
        }
        qsort(ks, n, sizeof ks[0], cmp_keyed);
        float sum = 0.0f;
        for (uint32_t i = 0; i < k; i++) sum += score[ks[i].idx];
        for (uint32_t i = 0; i < k; i++) {
            cr_assert_eq(rt.expert[i], ks[i].idx, "trial %d k %u: rank %u is %u, want %u", t, k, i,
                         rt.expert[i], ks[i].idx);
            float w = score[ks[i].idx] / (sum + 1e-20f) * 2.5f;
            cr_assert_eq(memcmp(&rt.weight[i], &w, 4), 0, "trial %d rank %u weight", t, i);
        }
    }
}
