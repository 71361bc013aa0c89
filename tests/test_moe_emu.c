/* test_moe_emu.c - the CPU emulation of the GPU MoE arithmetic (compute/moe_emu.h)
 * against straightforward f32/f64 math on dequantized weights (sl_quant_decode).
 *
 * Weights are random raw blocks (every code and scale pattern occurs) with sane f16
 * scales; inputs are fresh each run (seed from the clock, printed). Tolerances:
 *  - one Q2_K/Q3_K row: the only approximation is q8_1 of the activation, whose error
 *    per element is at most d/2 (d = amax/127 of its block), so
 *    |emu - exact| <= sum_i |w_i| * d_i/2 + 1e-5 * sum_i |w_i x_i|   (f32 rounding);
 *  - BF16 rows and router logits: f32 accumulation only, <= 1e-5 * sum_i |w_i x_i|;
 *  - exp: <= 3 ulp-ish (4e-7 relative) of libm's expf;
 *  - a whole layer vs the f32 reference: rms(diff) <= 2% of rms(ref) and max |diff|
 *    <= 10% of max |ref| (q8_1 of x and of h, plus bf16 flips of g/u/h near ties).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe_emu.h"
#include "quant.h"
#include "moe_fixture.h"

static void seed_once(void)
{
    if (rng_state) return;
    rng_state = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL | 1;
    printf("test_moe_emu: seed %llu\n", (unsigned long long)rng_state);
}

/* n values of random Q2_K (type 10) or Q3_K (11) blocks; d scaled by `scale`. */

TestSuite(moe_emu, .init = seed_once);

Test(moe_emu, exp_matches_libm)
{
    for (int i = 0; i < 200000; i++) {
        const float x = -100.0f + 188.0f * urand();
        const float a = sl_emu_exp(x), b = expf(x);
        if (b < 1e-37f) continue; /* subnormal results: absolute error is what matters */
        cr_assert(fabsf(a - b) <= 4e-7f * b, "exp(%.9g) = %.9g, libm %.9g", x, a, b);
    }
    cr_assert(isinf(sl_emu_exp(89.0f)));
    cr_assert_eq(sl_emu_exp(-110.0f), 0.0f);
    cr_assert_eq(sl_emu_exp(0.0f), 1.0f);
}

Test(moe_emu, bf16_round_matches_quant)
{
    const float special[] = {0.0f,     -0.0f,    1.0f,      1.00390625f, 1.01171875f, 3.4e38f,
                             -3.4e38f, INFINITY, -INFINITY, NAN,         1e-40f};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++)
        cr_assert_eq(sl_emu_bf16_bits(special[i]), sl_f32_to_bf16(special[i]), "%g", special[i]);
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)rnd();
        float f;
        memcpy(&f, &u, 4);
        cr_assert_eq(sl_emu_bf16_bits(f), sl_f32_to_bf16(f), "bits %08x", u);
    }
}

/* The embedding row the GPU decodes (sl_emu_embed_q2_k, the kernel's arithmetic) is
 * the host path's: sl_quant_decode then sl_f32_to_bf16, bit for bit, over random
 * blocks with normal, subnormal, zero and negative scales. */
Test(moe_emu, embed_q2_k_matches_decode)
{
    const uint32_t dim = 1024, rows = 64;
    uint8_t *tab = rand_blocks(SL_QTYPE_Q2_K, (uint64_t)dim * rows, 0.25f);
    const uint16_t odd[] = {0x0001, 0x03ff, 0x8000, 0x0000, 0xbc00, 0x7bff, 0x8123};
    for (uint32_t k = 0; k < sizeof odd / sizeof *odd; k++) { /* d, dmin of early blocks */
        memcpy(tab + 84 * k + 80, &odd[k], 2);
        memcpy(tab + 84 * (k + 1) + 82, &odd[k], 2);
    }
    float *f = malloc(dim * sizeof(float));
    uint16_t *got = malloc(dim * 2);
    for (uint32_t r = 0; r < rows; r++) {
        const uint8_t *row = tab + (size_t)r * (dim / 256) * 84;
        cr_assert_eq(sl_quant_decode(SL_QTYPE_Q2_K, row, f, dim), 0);
        sl_emu_embed_q2_k(row, dim, got);
        for (uint32_t i = 0; i < dim; i++)
            cr_assert_eq(got[i], sl_f32_to_bf16(f[i]), "row %u value %u: %04x vs %04x (%g)", r, i,
                         got[i], sl_f32_to_bf16(f[i]), f[i]);
    }
    free(f);
    free(got);
    free(tab);
}

/* The device layout of a Q3_K down: each block's 110 bytes in place at 112-byte steps,
 * the two bytes after them zero (whatever the buffer held). */
Test(moe_emu, pack_q3_k_layout)
{
    enum { N = 5 };
    uint8_t src[N * 110], dst[N * SL_Q3K_PACKED];
    for (int i = 0; i < N * 110; i++) src[i] = (uint8_t)(i * 37 + 11);
    memset(dst, 0xAA, sizeof dst);
    sl_emu_pack_q3_k(src, N, dst);
    for (int b = 0; b < N; b++) {
        cr_assert_eq(memcmp(dst + b * SL_Q3K_PACKED, src + b * 110, 110), 0, "block %d", b);
        cr_assert_eq(dst[b * SL_Q3K_PACKED + 110], 0, "block %d pad", b);
        cr_assert_eq(dst[b * SL_Q3K_PACKED + 111], 0, "block %d pad", b);
    }
}

/* The tiled layout (bench's sandbox down): every row of two 8-row tiles read back from it
 * as the lanes read it gives sl_emu_dot_q3_k's bits for the raw row, with random blocks
 * (every scale and high bit taken), activations of three magnitudes, and a zero block;
 * the pad bytes are zero whatever the buffer held. */
Test(moe_emu, q3_k_tiled_layout)
{
    enum { ROWS = 16, NB = 9, N = NB * 256 };
    uint8_t *raw = rand_blocks(SL_QTYPE_Q3_K, ROWS * N, 0.01f);
    uint8_t *tb = malloc((size_t)ROWS / 8 * NB * SL_Q3K_TB);
    memset(tb, 0xAA, (size_t)ROWS / 8 * NB * SL_Q3K_TB);
    sl_emu_pack_q3_k_tb(raw, ROWS, NB, tb);
    for (int k = 0; k < ROWS / 8 * NB; k++)
        for (int i = 880; i < SL_Q3K_TB; i++) cr_assert_eq(tb[k * SL_Q3K_TB + i], 0, "pad %d", k);
    sl_emu_act act = {N, malloc(N), malloc(N / 32 * sizeof(float)), malloc(N / 16 * 4)};
    float *x = malloc(N * sizeof(float));
    for (int pass = 0; pass < 3; pass++) {
        for (int i = 0; i < N; i++) x[i] = nrand() * (pass == 0 ? 1.0f : pass == 1 ? 1e3f : 1e-3f);
        if (pass == 2) memset(x + 256, 0, 32 * sizeof(float)); /* an all-zero q8_1 block */
        sl_emu_act_quant(x, N, &act);
        for (int r = 0; r < ROWS; r++) {
            const float want = sl_emu_dot_q3_k(raw + (size_t)r * NB * 110, &act);
            const float got = sl_emu_dot_q3_k_tb(tb + (size_t)(r / 8) * NB * SL_Q3K_TB,
                                                 (uint32_t)(r % 8), NB, &act);
            cr_assert_eq(memcmp(&got, &want, 4), 0, "pass %d row %d: %.9g vs %.9g", pass, r, got,
                         want);
        }
    }
    free(x);
    free(act.qs);
    free(act.d);
    free(act.sum16);
    free(tb);
    free(raw);
}

Test(moe_emu, swiglu_clamps)
{
    /* up to [-10, 10], gate to (-inf, 10] */
    const float hi = sl_emu_swiglu(50.0f, 50.0f, 1.0f, 10.0f);
    const float want = sl_emu_bf16_round(10.0f / (1.0f + expf(-10.0f)) * 10.0f);
    cr_assert(fabsf(hi - want) <= 1e-2f * want, "%g vs %g", hi, want);
    const float lo = sl_emu_swiglu(50.0f, -50.0f, 1.0f, 10.0f);
    cr_assert_eq(lo, -hi);
    /* a very negative gate is not clamped: silu(-30) * 10 is tiny, not silu(-10) * 10 */
    const float neg = sl_emu_swiglu(-30.0f, 10.0f, 1.0f, 10.0f);
    cr_assert(fabsf(neg) < 1e-10f, "%g", neg);
    /* the routing weight scales h before the bf16 rounding */
    const float w = sl_emu_swiglu(1.0f, 2.0f, 1.5f, 10.0f);
    const float ref = 1.0f / (1.0f + expf(-1.0f)) * 2.0f * 1.5f;
    cr_assert(fabsf(w - ref) <= 4e-3f * ref, "%g vs %g", w, ref);
}

/* One row of `type` against fresh activations, vs the exact dot of the dequantized row
 * with the unquantized activation, within the q8_1 bound. */
static void check_rows(uint32_t type, uint32_t n, int rows)
{
    sl_emu_act act = {n, malloc(n), malloc(n / 32 * sizeof(float)), malloc(n / 16 * 4)};
    float *x = malloc(n * sizeof(float));
    for (int r = 0; r < rows; r++) {
        for (uint32_t i = 0; i < n; i++) x[i] = nrand() * (r % 3 == 0 ? 10.0f : 1.0f);
        if (r == 1) memset(x, 0, 32 * sizeof(float)); /* an all-zero q8_1 block */
        sl_emu_act_quant(x, n, &act);
        void *blk = rand_blocks(type, n, 0.01f);
        float *w = decode(type, blk, n);
        const float got =
            type == SL_QTYPE_Q2_K ? sl_emu_dot_q2_k(blk, &act) : sl_emu_dot_q3_k(blk, &act);
        double exact = 0, bound = 0, mag = 0;
        for (uint32_t i = 0; i < n; i++) {
            exact += (double)w[i] * x[i];
            bound += fabs((double)w[i]) * act.d[i / 32] * 0.5;
            mag += fabs((double)w[i] * x[i]);
        }
        bound += 1e-5 * mag;
        cr_assert(fabs(got - exact) <= bound, "type %u n %u row %d: %.9g vs %.9g (bound %.3g)",
                  type, n, r, got, exact, bound);
        free(blk);
        free(w);
    }
    free(x);
    free(act.qs);
    free(act.d);
    free(act.sum16);
}

Test(moe_emu, q2_k_rows_within_q8_bound)
{
    check_rows(SL_QTYPE_Q2_K, 256, 50);
    check_rows(SL_QTYPE_Q2_K, 1280, 30);
    check_rows(SL_QTYPE_Q2_K, 5120, 20);
}

Test(moe_emu, q3_k_rows_within_q8_bound)
{
    check_rows(SL_QTYPE_Q3_K, 256, 50);
    check_rows(SL_QTYPE_Q3_K, 2304, 30);
}

Test(moe_emu, router_logits_f32)
{
    const uint32_t ne = 16, dim = 5120;
    uint16_t *w = rand_bf16((uint64_t)ne * dim, 0.05f), *x = rand_bf16(dim, 1.0f);
    float logits[16];
    for (int t = 0; t < 2; t++) {
        const float temp = t ? 2.0f : 1.0f;
        sl_emu_router_logits(w, x, ne, dim, temp, logits);
        for (uint32_t e = 0; e < ne; e++) {
            double ref = 0, mag = 0;
            for (uint32_t i = 0; i < dim; i++) {
                const double p =
                    (double)sl_bf16_to_f32(w[(size_t)e * dim + i]) * sl_bf16_to_f32(x[i]);
                ref += p;
                mag += fabs(p);
            }
            cr_assert(fabs(logits[e] * temp - ref) <= 1e-5 * mag + 1e-30, "e %u: %g vs %g", e,
                      logits[e], ref);
        }
    }
    free(w);
    free(x);
}

/* ---- a whole layer ---- */

typedef struct layer {
    sl_moe_shape s;
    uint16_t *x;
    sl_moe_route route;
    sl_moe_expert_w w[8], sh;
    void *buf[32];
    int nbuf;
} layer;

static void *keep(layer *L, void *p)
{
    L->buf[L->nbuf++] = p;
    return p;
}

static void make_layer(layer *L, uint32_t dim, uint32_t inter, uint32_t n_used, int sh_bf16)
{
    memset(L, 0, sizeof *L);
    L->s = (sl_moe_shape){.dim = dim,
                          .inter = inter,
                          .n_expert = 384,
                          .n_used = n_used,
                          .gate_type = SL_QTYPE_Q2_K,
                          .up_type = SL_QTYPE_Q2_K,
                          .down_type = SL_QTYPE_Q3_K,
                          .sh_gate_type = sh_bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q2_K,
                          .sh_up_type = sh_bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q2_K,
                          .sh_down_type = sh_bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q3_K,
                          .route_scale = 1.5f,
                          .norm_topk = 1,
                          .swiglu_limit = 10.0f,
                          .gate_temp = 1.0f};
    const float gs = 0.004f * sqrtf(5120.0f / dim), ds = 0.0005f * sqrtf(2304.0f / inter);
    L->x = keep(L, rand_bf16(dim, 1.0f));
    float wsum = 0;
    for (uint32_t k = 0; k < n_used; k++) {
        uint32_t e;
        int dup;
        do { /* distinct ids */
            e = (uint32_t)(rnd() % 384);
            dup = 0;
            for (uint32_t j = 0; j < k; j++) dup |= L->route.expert[j] == e;
        } while (dup);
        L->route.expert[k] = e;
        L->route.weight[k] = 0.2f + urand();
        wsum += L->route.weight[k];
        L->w[k].gate = keep(L, rand_blocks(SL_QTYPE_Q2_K, (uint64_t)dim * inter, gs));
        L->w[k].up = keep(L, rand_blocks(SL_QTYPE_Q2_K, (uint64_t)dim * inter, gs));
        L->w[k].down = keep(L, rand_blocks(SL_QTYPE_Q3_K, (uint64_t)dim * inter, ds));
    }
    for (uint32_t k = 0; k < n_used; k++) L->route.weight[k] *= 1.5f / wsum;
    if (sh_bf16) {
        L->sh.gate = keep(L, rand_bf16((uint64_t)dim * inter, 0.06f * sqrtf(512.0f / dim)));
        L->sh.up = keep(L, rand_bf16((uint64_t)dim * inter, 0.06f * sqrtf(512.0f / dim)));
        L->sh.down = keep(L, rand_bf16((uint64_t)dim * inter, 0.02f * sqrtf(256.0f / inter)));
    } else {
        L->sh.gate = keep(L, rand_blocks(SL_QTYPE_Q2_K, (uint64_t)dim * inter, gs));
        L->sh.up = keep(L, rand_blocks(SL_QTYPE_Q2_K, (uint64_t)dim * inter, gs));
        L->sh.down = keep(L, rand_blocks(SL_QTYPE_Q3_K, (uint64_t)dim * inter, ds));
    }
}

static void free_layer(layer *L)
{
    for (int i = 0; i < L->nbuf; i++) free(L->buf[i]);
}

/* The textbook layer (MODEL.md §7.5-7): dequantized weights, unquantized activations,
 * f64 dot products rounded to f32, libm expf. */

static void ref_layer(const layer *L, float *y)
{
    const sl_moe_shape *s = &L->s;
    float *x = malloc(s->dim * sizeof(float)), *ye = malloc(s->dim * sizeof(float));
    for (uint32_t i = 0; i < s->dim; i++) x[i] = sl_bf16_to_f32(L->x[i]);
    for (uint32_t r = 0; r < s->dim; r++) y[r] = 0;
    uint32_t order[64];
    sl_emu_moe_order(&L->route, s->n_used, order);
    for (uint32_t k = 0; k < s->n_used; k++) {
        ref_expert(s, x, &L->w[order[k]], 0, L->route.weight[order[k]], ye);
        for (uint32_t r = 0; r < s->dim; r++) y[r] += ye[r];
    }
    ref_expert(s, x, &L->sh, s->sh_gate_type == SL_QTYPE_BF16, 1.0f, ye);
    for (uint32_t r = 0; r < s->dim; r++) y[r] += ye[r];
    free(x);
    free(ye);
}

static void check_layer(uint32_t dim, uint32_t inter, uint32_t n_used, int sh_bf16)
{
    layer L;
    make_layer(&L, dim, inter, n_used, sh_bf16);
    uint16_t *out = malloc(dim * 2);
    float *yf = malloc(dim * sizeof(float)), *ref = malloc(dim * sizeof(float));
    sl_err err = {0};
    cr_assert_eq(sl_emu_moe(&L.s, L.x, &L.route, L.w, &L.sh, out, yf, NULL, &err), 0, "%s",
                 err.msg);
    ref_layer(&L, ref);
    double se = 0, sr = 0, me = 0, mr = 0;
    for (uint32_t r = 0; r < dim; r++) {
        cr_assert_eq(out[r], sl_f32_to_bf16(yf[r]));
        const double e = fabs((double)yf[r] - ref[r]);
        se += e * e;
        sr += (double)ref[r] * ref[r];
        me = fmax(me, e);
        mr = fmax(mr, fabs(ref[r]));
    }
    const double rel = sqrt(se / sr);
    printf("layer dim %u inter %u n %u shared %s: rms err %.3g%%, max err %.3g%% of max\n", dim,
           inter, n_used, sh_bf16 ? "bf16" : "q", 100 * rel, 100 * me / mr);
    cr_assert(sr > 0);
    cr_assert(rel <= 0.02, "rms(diff)/rms(ref) = %g", rel);
    cr_assert(me <= 0.10 * mr, "max diff %g vs max ref %g", me, mr);

    /* the same experts in another rank order give the same bytes */
    layer P = L;
    for (uint32_t k = 0; k < n_used; k++) {
        const uint32_t j = n_used - 1 - k;
        P.route.expert[k] = L.route.expert[j];
        P.route.weight[k] = L.route.weight[j];
        P.w[k] = L.w[j];
    }
    uint16_t *out2 = malloc(dim * 2);
    cr_assert_eq(sl_emu_moe(&P.s, P.x, &P.route, P.w, &P.sh, out2, NULL, NULL, &err), 0);
    cr_assert_eq(memcmp(out, out2, dim * 2), 0, "rank order changed the output");
    free(out2);
    free(out);
    free(yf);
    free(ref);
    free_layer(&L);
}

Test(moe_emu, layer_vs_f32_reference_small)
{
    check_layer(512, 256, 3, 0);
    check_layer(1024, 512, 6, 1);
}

Test(moe_emu, layer_vs_f32_reference_real_dims, .timeout = 240)
{
    check_layer(5120, 2304, 2, 0);
}

Test(moe_emu, rejects_bad_shapes)
{
    layer L;
    make_layer(&L, 512, 256, 2, 0);
    uint16_t out[512];
    sl_err err = {0};
    L.s.dim = 500;
    cr_assert_eq(sl_emu_moe(&L.s, L.x, &L.route, L.w, NULL, out, NULL, NULL, &err), SL_EINVAL);
    L.s.dim = 512;
    L.s.down_type = SL_QTYPE_Q4_K;
    cr_assert_eq(sl_emu_moe(&L.s, L.x, &L.route, L.w, NULL, out, NULL, NULL, &err),
                 SL_EUNSUPPORTED);
    free_layer(&L);
}

/* Residual + ffn_norm: against f64 math (the only roundings are the f32 steps and the
 * final bf16, so x is within one bf16 ulp plus a few f32 ulps), the residual exact,
 * and the sum order the one documented (a permutation of h within a lane's stride
 * class changes nothing; the lanes' tree is fixed). */
Test(moe_emu, residual_norm_against_f64)
{
    const uint32_t dim = 5120;
    uint16_t *h = rand_bf16(dim, 3.0f), *y = rand_bf16(dim, 1.0f), *x = malloc(dim * 2);
    uint16_t *h0 = malloc(dim * 2);
    float *w = malloc(dim * sizeof(float));
    for (uint32_t i = 0; i < dim; i++) w[i] = 0.75f + 0.001f * (float)(i % 100);
    memcpy(h0, h, dim * 2);
    sl_emu_residual_norm(dim, h, y, w, 1e-6f, x);
    double ss = 0;
    for (uint32_t i = 0; i < dim; i++) {
        float sum = sl_bf16_to_f32(h0[i]) + sl_bf16_to_f32(y[i]);
        cr_assert_eq(h[i], sl_f32_to_bf16(sum), "residual %u", i);
        ss += (double)sl_bf16_to_f32(h[i]) * sl_bf16_to_f32(h[i]);
    }
    double r = 1.0 / sqrt(ss / dim + 1e-6);
    for (uint32_t i = 0; i < dim; i++) {
        double want = (double)w[i] * sl_bf16_to_f32(h[i]) * r, got = sl_bf16_to_f32(x[i]);
        cr_assert_leq(fabs(got - want), fabs(want) * (1.0 / 256 + 1e-5) + 1e-30, "x[%u] %g vs %g",
                      i, got, want);
    }
    /* Without y: h untouched; without w: x untouched. */
    uint16_t *x2 = malloc(dim * 2);
    memcpy(h0, h, dim * 2);
    memset(x2, 0xAB, dim * 2);
    sl_emu_residual_norm(dim, h, NULL, NULL, 1e-6f, x2);
    cr_assert_eq(memcmp(h, h0, dim * 2), 0);
    cr_assert_eq(x2[0], 0xABAB);
    sl_emu_residual_norm(dim, h, NULL, w, 1e-6f, x2);
    cr_assert_eq(memcmp(x2, x, dim * 2), 0, "the norm alone gives the same x");
    free(h);
    free(y);
    free(x);
    free(x2);
    free(h0);
    free(w);
}
