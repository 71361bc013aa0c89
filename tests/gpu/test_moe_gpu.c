/* test_moe_gpu.c - the MoE kernels (compute/moe.cu) against the CPU emulation of their
 * arithmetic (compute/moe_emu.c) and against a plain f32 reference. GPU suite: skips,
 * saying so, without a GPU.
 *
 * Fresh random inputs each run (seed from the clock, printed); every output buffer is
 * filled with NaN bytes (0xFF) before the launch. Claims (docs/kernels.md says why):
 *  - q8_1 of the activation, router logits, SwiGLU outputs h, their q8_1 codes and
 *    scales, the shared expert's output, the f32 sum and the bf16 output: BIT-EXACT
 *    with the emulation (same operations in the same order on both sides);
 *  - vs the f32 reference (dequantized weights, unquantized activations): rms(diff)
 *    <= 2% of rms(ref), max |diff| <= 10% of max |ref| (the q8_1 error of x and h);
 *  - the output does not depend on the rank order of the experts, on whether their
 *    weights sit in device memory or in registered (zero-copy) host memory (bulk-copy
 *    or register-staged kernels), or on how the hits-first split divided the ranks.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu.h"
#include "moe_emu.h"
#include "quant.h"
#include "router.h"
#include "../moe_fixture.h"

static int have_gpu(void)
{
    sl_err err = {0};
    int n = 0;
    cr_assert_eq(sl_gpu_device_count(&n, &err), 0, "%s", err.msg);
    if (n == 0) return 0;
    if (!rng_state) {
        rng_state = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL | 1;
        printf("test_moe_gpu: seed %llu\n", (unsigned long long)rng_state);
    }
    return 1;
}

#define NEED_GPU()                                                                                 \
    do {                                                                                           \
        if (!have_gpu()) cr_skip_test("no GPU present: GPU tests skipped");                        \
    } while (0)

static sl_moe_shape make_shape(uint32_t dim, uint32_t inter, uint32_t n_used, int sh_bf16)
{
    return (sl_moe_shape){.dim = dim,
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
}

/* A context for shape s on device 0 (the test fails if it cannot open). */
static sl_gpu_ctx *open_gpu(const sl_moe_shape *s)
{
    sl_err err = {0};
    sl_gpu_ctx *c = NULL;
    cr_assert_eq(sl_gpu_open(&c, 0, s, &err), 0, "%s", err.msg);
    return c;
}

static void *to_dev(sl_gpu_ctx *c, const void *host, size_t bytes)
{
    sl_err err = {0};
    void *d = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &d, bytes, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_upload(c, d, host, bytes, &err), 0, "%s", err.msg);
    return d;
}

static void poison_dev(sl_gpu_ctx *c, void *dev, size_t bytes)
{
    sl_err err = {0};
    void *p = malloc(bytes);
    memset(p, 0xFF, bytes);
    cr_assert_eq(sl_gpu_upload(c, dev, p, bytes, &err), 0, "%s", err.msg);
    free(p);
}

Test(moe_gpu, q8_1_bit_exact)
{
    NEED_GPU();
    sl_moe_shape s = make_shape(512, 256, 2, 0);
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    const uint32_t n = 5120;
    uint16_t *x = rand_bf16(n, 3.0f);
    for (int i = 0; i < 32; i++) x[64 + i] = 0; /* an all-zero block */
    x[100] = sl_f32_to_bf16(2.5f * 1e-3f);      /* assorted magnitudes */
    float *xf = malloc(n * sizeof(float));
    for (uint32_t i = 0; i < n; i++) xf[i] = sl_bf16_to_f32(x[i]);
    sl_block_q8_1 *want = malloc(n / 32 * sizeof *want), *got = malloc(n / 32 * sizeof *got);
    cr_assert_eq(sl_quant_q8_1(xf, want, n), 0);
    void *xd = to_dev(c, x, n * 2);
    void *qd = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &qd, n / 32 * sizeof *got, &err), 0);
    poison_dev(c, qd, n / 32 * sizeof *got);
    cr_assert_eq(sl_gpu_quant_q8_1(c, xd, n, qd, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, got, qd, n / 32 * sizeof *got, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(got, want, n / 32 * sizeof *got), 0, "q8_1 blocks differ");
    sl_gpu_free(c, xd);
    sl_gpu_free(c, qd);
    sl_gpu_close(&c);
    free(x);
    free(xf);
    free(want);
    free(got);
}

/* sl_gpu_upload_down's tiling against sl_emu_pack_q3_k_tb, byte for byte: one 8-row
 * tile, a few, and more than a stage holds (taken a stage at a time), each into a
 * poisoned buffer whose bytes past the down must stay as they were; then more
 * asynchronous uploads than there are stages (each stage reused after its tiling) and
 * one wait; and the refusals (rows of one block, inter 256). Then two tiles of rows of
 * nine blocks (inter 2304). */
Test(moe_gpu, pack_q3_k_bytes)
{
    NEED_GPU();
    sl_moe_shape s = make_shape(512, 256, 2, 0);
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    const uint64_t counts[] = {1, 3, 5761}; /* tiles: a stage holds 64 at this shape */
    for (int k = 0; k < 3; k++) {
        const uint64_t n = counts[k] * 8, raw = n * 110, pk = sl_gpu_packed_bytes(raw);
        cr_assert_eq(pk, counts[k] * SL_Q3K_TB);
        uint8_t *src = rand_blocks(SL_QTYPE_Q3_K, n * 256, 0.5f);
        uint8_t *want = malloc(pk + 256), *got = malloc(pk + 256);
        sl_emu_pack_q3_k_tb(src, (uint32_t)n, 1, want);
        memset(want + pk, 0xFF, 256); /* the poison past the down */
        void *d = NULL;
        cr_assert_eq(sl_gpu_malloc(c, &d, pk + 256, &err), 0, "%s", err.msg);
        poison_dev(c, d, pk + 256);
        cr_assert_eq(sl_gpu_upload_down(c, d, src, raw, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_download(c, got, d, pk + 256, &err), 0, "%s", err.msg);
        uint64_t i = 0; /* the first byte that differs, if any */
        while (i < pk + 256 && got[i] == want[i]) i++;
        cr_assert_eq(i, pk + 256, "%llu rows: byte %llu is 0x%02x, want 0x%02x",
                     (unsigned long long)n, (unsigned long long)i, i < pk + 256 ? got[i] : 0,
                     i < pk + 256 ? want[i] : 0);
        if (k == 0) {
            cr_assert_eq(sl_gpu_upload_down(c, d, src, 109, &err), SL_EINVAL);
            cr_assert(strstr(err.msg, "Q3_K blocks"), "%s", err.msg);
            cr_assert_eq(sl_gpu_upload_down(c, d, src, 7 * 110, &err), SL_EINVAL);
            cr_assert(strstr(err.msg, "8-row tiles"), "%s", err.msg);
            cr_assert_eq(sl_gpu_upload_down(c, (uint8_t *)d + 4, src, 880, &err), SL_EINVAL);
            cr_assert_eq(sl_gpu_upload_down(c, NULL, src, 880, &err), SL_EINVAL);
            cr_assert_eq(sl_gpu_upload_down_async(c, d, src, 65 * 880, &err), SL_EINVAL);
            cr_assert(strstr(err.msg, "more than a down"), "%s", err.msg);
        }
        sl_gpu_free(c, d);
        free(src);
        free(want);
        free(got);
    }
    enum { UPS = 11 }; /* more than the stages: each reused after its packing */
    const uint64_t n = 512, raw = n * 110, pk = n / 8 * SL_Q3K_TB; /* 64 tiles: one down */
    uint8_t *src[UPS], *want = malloc(pk), *got = malloc(pk);
    void *d[UPS];
    for (int u = 0; u < UPS; u++) {
        src[u] = rand_blocks(SL_QTYPE_Q3_K, n * 256, 0.5f);
        cr_assert_eq(sl_gpu_malloc(c, &d[u], pk, &err), 0, "%s", err.msg);
        poison_dev(c, d[u], pk);
    }
    for (int u = 0; u < UPS; u++) /* the copies and packings overlap; one wait at the end */
        cr_assert_eq(sl_gpu_upload_down_async(c, d[u], src[u], raw, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_sync(c, &err), 0, "%s", err.msg);
    for (int u = 0; u < UPS; u++) {
        sl_emu_pack_q3_k_tb(src[u], (uint32_t)n, 1, want);
        cr_assert_eq(sl_gpu_download(c, got, d[u], pk, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(got, want, pk), 0, "async upload %d of %d differs", u, UPS);
        sl_gpu_free(c, d[u]);
        free(src[u]);
    }
    free(want);
    free(got);
    sl_gpu_close(&c);

    s = make_shape(512, 2304, 2, 0);
    c = open_gpu(&s);
    const uint64_t n9 = 16 * 9, pk9 = sl_gpu_packed_bytes(n9 * 110); /* blocks, tiled bytes */
    cr_assert_eq(pk9, 2 * 9 * SL_Q3K_TB);
    uint8_t *src9 = rand_blocks(SL_QTYPE_Q3_K, n9 * 256, 0.5f);
    uint8_t *want9 = malloc(pk9), *got9 = malloc(pk9);
    sl_emu_pack_q3_k_tb(src9, 16, 9, want9);
    void *d9 = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &d9, pk9, &err), 0, "%s", err.msg);
    poison_dev(c, d9, pk9);
    cr_assert_eq(sl_gpu_upload_down(c, d9, src9, n9 * 110, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, got9, d9, pk9, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(got9, want9, pk9), 0, "rows of nine blocks differ");
    sl_gpu_free(c, d9);
    free(src9);
    free(want9);
    free(got9);
    sl_gpu_close(&c);
}

/* The embedding row on the device: kernel vs sl_emu_embed_q2_k, bit for bit, for
 * rows at the table's start, middle and end. */
Test(moe_gpu, embed_q2_k_bit_exact)
{
    NEED_GPU();
    const uint32_t dim = 5120, rows = 300;
    sl_moe_shape s = make_shape(dim, 256, 2, 0);
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    const size_t rb = dim / 256 * 84;
    uint8_t *tab = rand_blocks(SL_QTYPE_Q2_K, (uint64_t)dim * rows, 0.5f);
    void *td = to_dev(c, tab, rb * rows), *hd = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &hd, dim * 2, &err), 0);
    uint16_t *want = malloc(dim * 2), *got = malloc(dim * 2);
    const uint32_t pick[] = {0, 1, 150, rows - 1};
    for (int k = 0; k < 4; k++) {
        poison_dev(c, hd, dim * 2);
        cr_assert_eq(sl_gpu_embed_q2_k(c, td, pick[k], hd, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_download(c, got, hd, dim * 2, &err), 0, "%s", err.msg);
        sl_emu_embed_q2_k(tab + pick[k] * rb, dim, want);
        for (uint32_t i = 0; i < dim; i++)
            cr_assert_eq(got[i], want[i], "row %u value %u: %04x vs %04x", pick[k], i, got[i],
                         want[i]);
    }
    cr_assert_eq(sl_gpu_embed_q2_k(c, NULL, 0, hd, &err), SL_EINVAL);
    sl_gpu_free(c, td);
    sl_gpu_free(c, hd);
    sl_gpu_close(&c);
    free(tab);
    free(want);
    free(got);
}

/* Values whose bf16 roundings are the hard cases, among random ones: every 8th pair
 * subnormal (their sum is exact, but the normed x of such an h rounds as a subnormal),
 * the next a sum exactly halfway between two bf16 values (ties to even, both ways), the
 * next a sum that only sticky bits separate from a tie. */
static void edge_bf16(uint16_t *h, uint16_t *y, uint32_t n)
{
    for (uint32_t i = 0; i + 3 < n; i += 8) {
        const uint16_t sign = (uint16_t)(rnd() & 0x8000u);
        h[i + 1] = (uint16_t)(sign | (1 + rnd() % 0x7f));
        y[i + 1] = (uint16_t)((rnd() & 0x8000u) | (1 + rnd() % 0x7f));
        const uint16_t e = (uint16_t)(120 + rnd() % 12), m = (uint16_t)(rnd() % 128);
        h[i + 2] = (uint16_t)(e << 7 | m);                       /* (1 + m / 128) 2^(e - 127) */
        y[i + 2] = (uint16_t)((rnd() & 0x8000u) | (e - 8) << 7); /* half its ulp, either sign */
        h[i + 3] = (uint16_t)(e << 7 | m);
        y[i + 3] = (uint16_t)((e - 8) << 7 | (1 + rnd() % 127)); /* just past half an ulp */
    }
}

/* Residual + ffn_norm: kernel vs sl_emu_residual_norm, bit for bit, with and without
 * the residual and the norm (edge_bf16's values among the random ones). */
static void check_residual_norm(uint32_t dim)
{
    sl_moe_shape s = make_shape(dim, 256, 2, 0);
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    uint16_t *h = rand_bf16(dim, 4.0f), *y = rand_bf16(dim, 2.0f), *x = malloc(dim * 2);
    edge_bf16(h, y, dim);
    uint16_t *gh = malloc(dim * 2), *gx = malloc(dim * 2);
    float *w = malloc(dim * sizeof(float));
    for (uint32_t i = 0; i < dim; i++) w[i] = 0.5f + sl_bf16_to_f32(y[(i * 7) % dim]) * 0.25f;
    void *hd = to_dev(c, h, dim * 2), *yd = to_dev(c, y, dim * 2), *wd = to_dev(c, w, dim * 4);
    void *xd = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &xd, dim * 2, &err), 0);
    for (int mode = 0; mode < 3; mode++) { /* residual + norm, norm only, residual only */
        const uint16_t *yy = mode == 1 ? NULL : y;
        const float *ww = mode == 2 ? NULL : w;
        poison_dev(c, xd, dim * 2);
        cr_assert_eq(sl_gpu_residual_norm(c, hd, mode == 1 ? NULL : yd, mode == 2 ? NULL : wd,
                                          1e-6f, xd, &err),
                     0, "%s", err.msg);
        sl_emu_residual_norm(dim, h, yy, ww, 1e-6f, x);
        cr_assert_eq(sl_gpu_download(c, gh, hd, dim * 2, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(gh, h, dim * 2), 0, "dim %u mode %d: h differs", dim, mode);
        if (ww) {
            cr_assert_eq(sl_gpu_download(c, gx, xd, dim * 2, &err), 0, "%s", err.msg);
            for (uint32_t i = 0; i < dim; i++)
                cr_assert_eq(gx[i], x[i], "dim %u mode %d: x[%u] %04x vs %04x", dim, mode, i, gx[i],
                             x[i]);
        }
    }
    sl_gpu_free(c, hd);
    sl_gpu_free(c, yd);
    sl_gpu_free(c, wd);
    sl_gpu_free(c, xd);
    sl_gpu_close(&c);
    free(h);
    free(y);
    free(x);
    free(gh);
    free(gx);
    free(w);
}

Test(moe_gpu, residual_norm_bit_exact)
{
    NEED_GPU();
    check_residual_norm(256);
    check_residual_norm(5120);
    check_residual_norm(12288);
}

/* The residual and the norm inside the router (sl_gpu_route_start_norm): x, the new
 * residual (in the other buffer; h untouched) and the picks are the bits of
 * sl_emu_residual_norm then router.c, with and without the residual (edge_bf16's
 * values among the random ones); at 5120 (the router's form with constant bounds) and
 * 4096 (its general form) the router's CTAs compute the norm, at 8192 a norm kernel runs
 * before the router. */
static void check_route_norm(uint32_t dim)
{
    sl_moe_shape s = make_shape(dim, 256, 6, 0);
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    const uint32_t ne = s.n_expert;
    uint16_t *h = rand_bf16(dim, 4.0f), *y = rand_bf16(dim, 2.0f), *hh = malloc(dim * 2);
    uint16_t *x = malloc(dim * 2), *gh = malloc(dim * 2), *gx = malloc(dim * 2);
    edge_bf16(h, y, dim);
    uint16_t *rw = rand_bf16((uint64_t)ne * dim, 0.05f);
    float *w = malloc(dim * sizeof(float)), *bias = malloc(sizeof(float) * ne);
    float *logits = malloc(sizeof(float) * ne);
    for (uint32_t i = 0; i < dim; i++) w[i] = 0.5f + sl_bf16_to_f32(y[(i * 7) % dim]) * 0.25f;
    for (uint32_t e = 0; e < ne; e++) bias[e] = (float)(rnd() % 5) * 0.01f;
    void *hd = to_dev(c, h, dim * 2), *yd = to_dev(c, y, dim * 2), *wd = to_dev(c, w, dim * 4);
    void *rwd = to_dev(c, rw, (size_t)ne * dim * 2), *bd = to_dev(c, bias, sizeof(float) * ne);
    void *xd = NULL, *h2d = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &xd, dim * 2, &err), 0);
    cr_assert_eq(sl_gpu_malloc(c, &h2d, dim * 2, &err), 0);
    const sl_moe_layer_w lw = {rw, bias, {NULL, NULL, NULL}};
    for (int mode = 0; mode < 2; mode++) { /* residual + norm, norm only */
        const uint16_t *yy = mode ? NULL : y;
        memcpy(hh, h, dim * 2);
        sl_emu_residual_norm(dim, hh, yy, w, 1e-6f, x);
        sl_moe_route want, got;
        cr_assert_eq(sl_router_route(x, &lw, &s, logits, &want, &err), 0, "%s", err.msg);
        poison_dev(c, xd, dim * 2);
        poison_dev(c, h2d, dim * 2);
        const sl_gpu_norm n = {hd, mode ? NULL : yd, h2d, wd, 1e-6f};
        uint32_t started = 99;
        cr_assert_eq(sl_gpu_route_start_norm(c, &n, xd, rwd, bd, NULL, NULL, &err), 0, "%s",
                     err.msg);
        cr_assert_eq(sl_gpu_route_wait(c, &got, &started, &err), 0, "%s", err.msg);
        cr_assert_eq(started, 0u);
        for (uint32_t r = 0; r < s.n_used; r++) {
            cr_assert_eq(got.expert[r], want.expert[r], "dim %u mode %d rank %u: expert %u vs %u",
                         dim, mode, r, got.expert[r], want.expert[r]);
            cr_assert_eq(memcmp(&got.weight[r], &want.weight[r], 4), 0, "rank %u weight", r);
        }
        cr_assert_eq(sl_gpu_moe_abort(c, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_download(c, gx, xd, dim * 2, &err), 0, "%s", err.msg);
        for (uint32_t i = 0; i < dim; i++)
            cr_assert_eq(gx[i], x[i], "dim %u mode %d: x[%u] %04x vs %04x", dim, mode, i, gx[i],
                         x[i]);
        cr_assert_eq(sl_gpu_download(c, gh, hd, dim * 2, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(gh, h, dim * 2), 0, "dim %u mode %d: h was written", dim, mode);
        if (!mode) {
            cr_assert_eq(sl_gpu_download(c, gh, h2d, dim * 2, &err), 0, "%s", err.msg);
            cr_assert_eq(memcmp(gh, hh, dim * 2), 0, "dim %u: the residual differs", dim);
        }
    }
    /* the residual written over h while other CTAs read it: refused */
    const sl_gpu_norm bad = {hd, yd, hd, wd, 1e-6f};
    cr_assert_eq(sl_gpu_route_start_norm(c, &bad, xd, rwd, bd, NULL, NULL, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "h_out"), "%s", err.msg);
    void *bufs[] = {hd, yd, wd, rwd, bd, xd, h2d};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) sl_gpu_free(c, bufs[i]);
    sl_gpu_close(&c);
    free(h);
    free(y);
    free(hh);
    free(x);
    free(gh);
    free(gx);
    free(rw);
    free(w);
    free(bias);
    free(logits);
}

Test(moe_gpu, route_norm_bit_exact)
{
    NEED_GPU();
    check_route_norm(5120);
    check_route_norm(4096);
    check_route_norm(8192);
}

static void check_router(uint32_t dim, float temp)
{
    sl_moe_shape s = make_shape(dim, 256, 2, 0);
    s.gate_temp = temp;
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    uint16_t *w = rand_bf16((uint64_t)s.n_expert * dim, 0.05f), *x = rand_bf16(dim, 1.0f);
    float want[384], got[384];
    memset(got, 0xFF, sizeof got);
    sl_emu_router_logits(w, x, s.n_expert, dim, temp, want);
    void *wd = to_dev(c, w, (size_t)s.n_expert * dim * 2), *xd = to_dev(c, x, dim * 2);
    cr_assert_eq(sl_gpu_router_logits(c, xd, wd, got, &err), 0, "%s", err.msg);
    for (uint32_t e = 0; e < s.n_expert; e++)
        cr_assert_eq(memcmp(&got[e], &want[e], 4), 0, "dim %u expert %u: %.9g vs %.9g", dim, e,
                     got[e], want[e]);
    sl_gpu_free(c, wd);
    sl_gpu_free(c, xd);
    sl_gpu_close(&c);
    free(w);
    free(x);
}

Test(moe_gpu, router_bit_exact)
{
    NEED_GPU();
    check_router(5120, 1.0f);
    check_router(512, 0.7f);
}

/* The device's selection against router.c's on logits with exact ties, one-ulp near
 * ties, infinities, NaN, huge and tiny values, with and without bias and norm_topk. */
static void check_select(uint32_t n_expert, uint32_t k, int norm_topk, int with_bias, int kind)
{
    sl_moe_shape s = make_shape(256, 256, k, 0);
    s.n_expert = n_expert;
    s.norm_topk = norm_topk;
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(&s);
    float logits[1024], bias[1024];
    for (uint32_t e = 0; e < n_expert; e++) {
        const float u = urand();
        switch (kind) {
        case 0:
            logits[e] = (u - 0.5f) * 8.0f;
            break; /* plain */
        case 1:
            logits[e] = (float)(rnd() % 4) * 0.25f;
            break; /* exact ties */
        case 2:
            logits[e] = nextafterf(1.0f, (float)(rnd() % 3));
            break; /* 1-ulp ties */
        case 3:
            logits[e] = u < 0.1f   ? INFINITY
                        : u < 0.2f ? NAN
                        : u < 0.3f ? -INFINITY
                                   : (u - 0.5f) * 80.0f;
            break; /* non-finite */
        case 4:
            logits[e] = ldexpf(u, (int)(rnd() % 200) - 150);
            break; /* tiny to huge */
        default:   /* -40 .. -164000: subnormal and zero scores, the two-step scaling */
            logits[e] = -ldexpf(0.5f + u, (int)(rnd() % 11)) * 80.0f;
            break;
        }
        bias[e] = with_bias ? (float)(rnd() % 3) * 0.125f : 0.0f;
    }
    void *bd = with_bias ? to_dev(c, bias, sizeof(float) * n_expert) : NULL;
    sl_moe_route want, got;
    cr_assert_eq(sl_router_select(logits, with_bias ? bias : NULL, &s, &want, &err), 0, "%s",
                 err.msg);
    memset(&got, 0xFF, sizeof got);
    cr_assert_eq(sl_gpu_select(c, logits, bd, &got, &err), 0, "%s", err.msg);
    for (uint32_t r = 0; r < k; r++) {
        cr_assert_eq(got.expert[r], want.expert[r], "kind %d n %u k %u rank %u: expert %u vs %u",
                     kind, n_expert, k, r, got.expert[r], want.expert[r]);
        /* NaN weights (an infinite score) agree as NaN: its sign bit is the FPU's */
        const int both_nan = isnan(got.weight[r]) && isnan(want.weight[r]);
        cr_assert(both_nan || !memcmp(&got.weight[r], &want.weight[r], 4),
                  "kind %d rank %u: weight %.9g vs %.9g", kind, r, got.weight[r], want.weight[r]);
    }
    sl_gpu_free(c, bd);
    sl_gpu_close(&c);
}

Test(moe_gpu, select_bit_exact)
{
    NEED_GPU();
    for (int kind = 0; kind < 6; kind++)
        for (int rep = 0; rep < 4; rep++) {
            check_select(384, 6, 1, rep & 1, kind);
            check_select(64, 8, rep >> 1, rep & 1, kind);
            check_select(512, 1, 1, rep & 1, kind);
            check_select(1024, 6, 1, rep & 1, kind);
            check_select(100, 6, 1, rep & 1, kind); /* not whole warps */
            check_select(300, 8, rep >> 1, rep & 1, kind);
        }
    printf("gpu selection: 144 logit sets (ties, 1-ulp ties, inf/NaN, 2^-150..2^50, "
           "-40..-164000; 64 to 1024 experts) identical to sl_router_select\n");
}

/* ---- a whole layer ---- */

typedef struct layer {
    sl_moe_shape s;
    uint16_t *x;
    sl_moe_route route;
    sl_moe_expert_w w[8], sh; /* host copies */
} layer;

static void make_layer(layer *L, uint32_t dim, uint32_t inter, uint32_t n_used, int sh_bf16)
{
    memset(L, 0, sizeof *L);
    L->s = make_shape(dim, inter, n_used, sh_bf16);
    const float gs = 0.004f * sqrtf(5120.0f / dim), ds = 0.0005f * sqrtf(2304.0f / inter);
    const uint64_t n = (uint64_t)dim * inter;
    L->x = rand_bf16(dim, 1.0f);
    float wsum = 0;
    for (uint32_t k = 0; k < n_used; k++) {
        uint32_t e;
        int dup;
        do {
            e = (uint32_t)(rnd() % 384);
            dup = 0;
            for (uint32_t j = 0; j < k; j++) dup |= L->route.expert[j] == e;
        } while (dup);
        L->route.expert[k] = e;
        L->route.weight[k] = 0.2f + urand();
        wsum += L->route.weight[k];
        L->w[k].gate = rand_blocks(SL_QTYPE_Q2_K, n, gs);
        L->w[k].up = rand_blocks(SL_QTYPE_Q2_K, n, gs);
        L->w[k].down = rand_blocks(SL_QTYPE_Q3_K, n, ds);
    }
    for (uint32_t k = 0; k < n_used; k++) L->route.weight[k] *= 1.5f / wsum;
    if (sh_bf16) {
        L->sh.gate = rand_bf16(n, 0.06f * sqrtf(512.0f / dim));
        L->sh.up = rand_bf16(n, 0.06f * sqrtf(512.0f / dim));
        L->sh.down = rand_bf16(n, 0.02f * sqrtf(256.0f / inter));
    } else {
        L->sh.gate = rand_blocks(SL_QTYPE_Q2_K, n, gs);
        L->sh.up = rand_blocks(SL_QTYPE_Q2_K, n, gs);
        L->sh.down = rand_blocks(SL_QTYPE_Q3_K, n, ds);
    }
}

static void free_layer(layer *L)
{
    free(L->x);
    for (uint32_t k = 0; k < L->s.n_used; k++) {
        free((void *)L->w[k].gate);
        free((void *)L->w[k].up);
        free((void *)L->w[k].down);
    }
    free((void *)L->sh.gate);
    free((void *)L->sh.up);
    free((void *)L->sh.down);
}

static size_t bytes_of(uint32_t type, uint64_t n)
{
    return (size_t)sl_qtype_row_bytes(type, n);
}

/* Device-visible copies of an expert's weights: uploaded (a Q3_K down packed), or the host buffers
 * registered in place (mapped). */
static sl_moe_expert_w place(sl_gpu_ctx *c, const sl_moe_expert_w *h, const sl_moe_shape *s,
                             int bf16, int in_host, void **keep)
{
    const uint64_t n = (uint64_t)s->dim * s->inter;
    const size_t bg = bytes_of(bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q2_K, n);
    const size_t bd = bytes_of(bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q3_K, n);
    const void *src[3] = {h->gate, h->up, h->down};
    const size_t len[3] = {bg, bg, bd};
    void *dst[3];
    sl_err err = {0};
    for (int i = 0; i < 3; i++) {
        if (in_host) {
            cr_assert_eq(
                sl_gpu_host_register((void *)src[i], (len[i] + 4095) / 4096 * 4096, &dst[i], &err),
                0, "%s", err.msg);
            keep[i] = (void *)src[i];
        } else if (i == 2 && !bf16) { /* a Q3_K down: packed in device memory (gpu.h) */
            cr_assert_eq(sl_gpu_malloc(c, &dst[i], sl_gpu_packed_bytes(len[i]), &err), 0, "%s",
                         err.msg);
            cr_assert_eq(sl_gpu_upload_down(c, dst[i], src[i], len[i], &err), 0, "%s", err.msg);
            keep[i] = dst[i];
        } else {
            dst[i] = to_dev(c, src[i], len[i]);
            keep[i] = dst[i];
        }
    }
    return (sl_moe_expert_w){dst[0], dst[1], dst[2]};
}

static void unplace(sl_gpu_ctx *c, void **keep, int in_host)
{
    sl_err err = {0};
    for (int i = 0; i < 3; i++) {
        if (in_host)
            cr_assert_eq(sl_gpu_host_unregister(keep[i], &err), 0, "%s", err.msg);
        else
            sl_gpu_free(c, keep[i]);
    }
}

/* Runs the layer on the GPU (weights in device or registered host memory, experts
 * given in rank order or reversed) and returns bf16 out, f32 out and intermediates. */
typedef struct gpu_out {
    uint16_t *out;
    float *yf, *h, *hd, *h_sh, *y_sh;
    int8_t *hq;
} gpu_out;

static void run_gpu(const layer *L, int in_host, int reverse, gpu_out *o)
{
    const sl_moe_shape *s = &L->s;
    const uint32_t dim = s->dim, inter = s->inter, n = s->n_used;
    const int sh_bf16 = s->sh_gate_type == SL_QTYPE_BF16;
    sl_err err = {0};
    sl_gpu_ctx *c = open_gpu(s);
    void *keep[9][3];
    sl_moe_expert_w w[8];
    sl_moe_route route = L->route;
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t j = reverse ? n - 1 - k : k;
        route.expert[k] = L->route.expert[j];
        route.weight[k] = L->route.weight[j];
        w[k] = place(c, &L->w[j], s, 0, in_host, keep[k]);
    }
    const sl_moe_expert_w sh = place(c, &L->sh, s, sh_bf16, in_host, keep[8]);
    void *xd = to_dev(c, L->x, dim * 2), *od = NULL, *fd = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &od, dim * 2, &err), 0);
    cr_assert_eq(sl_gpu_malloc(c, &fd, dim * 4, &err), 0);
    poison_dev(c, od, dim * 2);
    poison_dev(c, fd, dim * 4);
    cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_routed(c, xd, &route, w, od, fd, &err), 0, "%s", err.msg);
    o->out = malloc(dim * 2);
    o->yf = malloc(dim * 4);
    o->h = malloc((size_t)n * inter * 4);
    o->hq = malloc((size_t)n * inter);
    o->hd = malloc((size_t)n * inter / 32 * 4);
    o->h_sh = malloc(inter * 4);
    o->y_sh = malloc(dim * 4);
    cr_assert_eq(sl_gpu_moe_peek(c, o->h, o->hq, o->hd, o->h_sh, o->y_sh, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, o->out, od, dim * 2, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, o->yf, fd, dim * 4, &err), 0, "%s", err.msg);
    for (uint32_t k = 0; k < n; k++) unplace(c, keep[k], in_host);
    unplace(c, keep[8], in_host);
    sl_gpu_free(c, xd);
    sl_gpu_free(c, od);
    sl_gpu_free(c, fd);
    sl_gpu_close(&c);
}

static void free_out(gpu_out *o)
{
    free(o->out);
    free(o->yf);
    free(o->h);
    free(o->hq);
    free(o->hd);
    free(o->h_sh);
    free(o->y_sh);
}

static void first_diff_f32(const char *what, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(memcmp(&a[i], &b[i], 4), 0, "%s[%zu]: gpu %.9g, emulation %.9g", what, i, a[i],
                     b[i]);
}

/* The plain f32 layer (MODEL.md §7.5-7) on dequantized weights. */

static void check_layer(uint32_t dim, uint32_t inter, uint32_t n_used, int sh_bf16)
{
    layer L;
    make_layer(&L, dim, inter, n_used, sh_bf16);
    const sl_moe_shape *s = &L.s;
    sl_err err = {0};

    /* the emulation, with its intermediates */
    uint16_t *eout = malloc(dim * 2);
    float *eyf = malloc(dim * 4), *eh = malloc((size_t)n_used * inter * 4);
    float *ehd = malloc((size_t)n_used * inter / 32 * 4), *eh_sh = malloc(inter * 4);
    float *ey_sh = malloc(dim * 4);
    int8_t *ehq = malloc((size_t)n_used * inter);
    sl_emu_trace tr = {eh, ehq, ehd, eh_sh, ey_sh};
    cr_assert_eq(sl_emu_moe(s, L.x, &L.route, L.w, &L.sh, eout, eyf, &tr, &err), 0, "%s", err.msg);

    for (int in_host = 0; in_host < 2; in_host++) {
        gpu_out o;
        run_gpu(&L, in_host, in_host, &o); /* host placement also reverses the rank order */
        const char *where = in_host ? "host-mapped" : "device";
        cr_assert_eq(memcmp(o.hq, ehq, (size_t)n_used * inter), 0, "%s: q8_1 codes of h differ",
                     where);
        first_diff_f32("h", o.h, eh, (size_t)n_used * inter);
        first_diff_f32("hd", o.hd, ehd, (size_t)n_used * inter / 32);
        first_diff_f32("h_sh", o.h_sh, eh_sh, inter);
        /* A K-quant shared expert in device memory runs inside the routed launches
         * when there is room (n_used < 8, and the bulk-copy down's stages fit shared
         * memory: not at inter 4608): its output goes straight into the sum and peek
         * gives NaN; elsewhere it runs on the side stream. */
        const int fits = 2 * 8 * (inter / 256) * SL_Q3K_TB + 2048 <= 227 * 1024;
        const int merged = !sh_bf16 && !in_host && n_used < 8 && fits; /* H100/H200 smem */
        cr_assert_eq(isnan(o.y_sh[0]) != 0, merged, "%s: shared expert merged %d", where, merged);
        if (!merged) first_diff_f32("y_sh", o.y_sh, ey_sh, dim);
        first_diff_f32("out_f32", o.yf, eyf, dim);
        cr_assert_eq(memcmp(o.out, eout, dim * 2), 0, "%s: bf16 output differs", where);
        free_out(&o);
    }

    /* loosely against the f32 reference */
    float *x = malloc(dim * 4), *ye = malloc(dim * 4), *ref = calloc(dim, 4);
    for (uint32_t i = 0; i < dim; i++) x[i] = sl_bf16_to_f32(L.x[i]);
    uint32_t order[64];
    sl_emu_moe_order(&L.route, n_used, order);
    for (uint32_t k = 0; k < n_used; k++) {
        ref_expert(s, x, &L.w[order[k]], 0, L.route.weight[order[k]], ye);
        for (uint32_t r = 0; r < dim; r++) ref[r] += ye[r];
    }
    ref_expert(s, x, &L.sh, sh_bf16, 1.0f, ye);
    double se = 0, sr = 0, me = 0, mr = 0;
    for (uint32_t r = 0; r < dim; r++) {
        ref[r] += ye[r];
        const double e = fabs((double)sl_bf16_to_f32(eout[r]) - ref[r]);
        se += e * e;
        sr += (double)ref[r] * ref[r];
        me = fmax(me, e);
        mr = fmax(mr, fabs(ref[r]));
    }
    printf("gpu layer dim %u inter %u n %u shared %s: bit-exact with the emulation "
           "(device and host-mapped); vs f32 reference rms %.3g%%, max %.3g%% of max\n",
           dim, inter, n_used, sh_bf16 ? "bf16" : "q2k/q3k", 100 * sqrt(se / sr), 100 * me / mr);
    cr_assert(sqrt(se / sr) <= 0.02, "rms diff %g", sqrt(se / sr));
    cr_assert(me <= 0.10 * mr);
    free(x);
    free(ye);
    free(ref);
    free(eout);
    free(eyf);
    free(eh);
    free(ehd);
    free(eh_sh);
    free(ey_sh);
    free(ehq);
    free_layer(&L);
}

Test(moe_gpu, layer_small_dims)
{
    NEED_GPU();
    check_layer(512, 256, 1, 0);
    check_layer(512, 256, 3, 1);
    check_layer(1280, 768, 8, 0);
    check_layer(512, 4608, 3, 0); /* no bulk-copy down fits: packed downs in k_down2 */
}

Test(moe_gpu, layer_real_dims, .timeout = 500)
{
    NEED_GPU();
    check_layer(5120, 2304, 6, 0);
}

Test(moe_gpu, layer_real_dims_bf16_shared, .timeout = 500)
{
    NEED_GPU();
    check_layer(5120, 2304, 6, 1);
}

/* The hits-first split: begin, parts of random subsets of the ranks in random order,
 * finish. Each expert's weights sit in device or registered host memory at random (so
 * one token mixes the bulk-copy and the register-staged kernels); the bytes must equal
 * the one-shot sl_gpu_moe_routed's and the emulation's. */
static void check_split(uint32_t dim, uint32_t inter, uint32_t n_used, int trials)
{
    layer L;
    make_layer(&L, dim, inter, n_used, 0);
    const sl_moe_shape *s = &L.s;
    sl_err err = {0};
    uint16_t *eout = malloc(dim * 2);
    float *eyf = malloc(dim * 4);
    cr_assert_eq(sl_emu_moe(s, L.x, &L.route, L.w, &L.sh, eout, eyf, NULL, &err), 0, "%s", err.msg);

    sl_gpu_ctx *c = open_gpu(s);
    void *keep[9][3];
    int host[9];
    sl_moe_expert_w w[8];
    char where[16] = "";
    for (uint32_t k = 0; k < n_used; k++) {
        host[k] = k == 0 ? 0 : k == n_used - 1 ? 1 : (int)(rnd() & 1); /* both kinds */
        where[k] = host[k] ? 'h' : 'd';
        w[k] = place(c, &L.w[k], s, 0, host[k], keep[k]);
    }
    host[8] = 0;
    const sl_moe_expert_w sh = place(c, &L.sh, s, 0, 0, keep[8]);
    void *xd = to_dev(c, L.x, dim * 2), *od = NULL, *fd = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &od, dim * 2, &err), 0);
    cr_assert_eq(sl_gpu_malloc(c, &fd, dim * 4, &err), 0);
    uint16_t *one = malloc(dim * 2), *got = malloc(dim * 2);
    float *onef = malloc(dim * 4), *gotf = malloc(dim * 4);

    poison_dev(c, od, dim * 2);
    poison_dev(c, fd, dim * 4);
    cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_routed(c, xd, &L.route, w, od, fd, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, one, od, dim * 2, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, onef, fd, dim * 4, &err), 0, "%s", err.msg);
    first_diff_f32("one-shot out_f32", onef, eyf, dim);
    cr_assert_eq(memcmp(one, eout, dim * 2), 0, "one-shot bf16 output differs (placement %s)",
                 where);

    { /* the device's ranks, their downs early, then the host's (the raw bulk-copy down) */
        uint32_t ranks[8], nd = 0, nh = 0;
        for (uint32_t k = 0; k < n_used; k++)
            if (!host[k]) ranks[nd++] = k;
        for (uint32_t k = 0; k < n_used; k++)
            if (host[k]) ranks[nd + nh++] = k;
        poison_dev(c, od, dim * 2);
        poison_dev(c, fd, dim * 4);
        cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_moe_begin(c, xd, &L.route, &err), 0, "%s", err.msg);
        if (nd) cr_assert_eq(sl_gpu_moe_part(c, ranks, nd, w, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_moe_down_early(c, &err), 0, "%s", err.msg);
        if (nh) cr_assert_eq(sl_gpu_moe_part(c, ranks + nd, nh, w, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_moe_finish(c, od, fd, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_download(c, gotf, fd, dim * 4, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(gotf, onef, dim * 4), 0, "device first, down early (placement %s)",
                     where);
    }
    for (int t = 0; t < trials; t++) {
        uint32_t ranks[8];
        for (uint32_t k = 0; k < n_used; k++) ranks[k] = k;
        for (uint32_t k = n_used; k > 1; k--) { /* Fisher-Yates */
            const uint32_t j = (uint32_t)(rnd() % k), tmp = ranks[k - 1];
            ranks[k - 1] = ranks[j];
            ranks[j] = tmp;
        }
        /* w_by_rank with other ranks' entries garbage: part must ignore them */
        poison_dev(c, od, dim * 2);
        poison_dev(c, fd, dim * 4);
        cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_moe_begin(c, xd, &L.route, &err), 0, "%s", err.msg);
        char parts[64] = "";
        for (uint32_t i = 0; i < n_used;) {
            const uint32_t len = 1 + (uint32_t)(rnd() % (n_used - i));
            sl_moe_expert_w wr[8];
            memset(wr, 0xA5, sizeof wr);
            for (uint32_t k = 0; k < len; k++) wr[ranks[i + k]] = w[ranks[i + k]];
            cr_assert_eq(sl_gpu_moe_part(c, ranks + i, len, wr, &err), 0, "%s", err.msg);
            snprintf(parts + strlen(parts), sizeof parts - strlen(parts), "%u@%u ", len, i);
            i += len;
            if (i < n_used && rnd() % 2) { /* the queued experts' down ahead of the rest */
                cr_assert_eq(sl_gpu_moe_down_early(c, &err), 0, "%s", err.msg);
                snprintf(parts + strlen(parts), sizeof parts - strlen(parts), "down ");
            }
        }
        cr_assert_eq(sl_gpu_moe_finish(c, od, fd, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_download(c, got, od, dim * 2, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_download(c, gotf, fd, dim * 4, &err), 0, "%s", err.msg);
        cr_assert_eq(memcmp(gotf, onef, dim * 4), 0, "split %s(placement %s): f32 differs", parts,
                     where);
        cr_assert_eq(memcmp(got, one, dim * 2), 0, "split %s(placement %s): bf16 differs", parts,
                     where);
    }

    /* Routing on the device: the picks are router.c's; with a device tier holding the
     * picks placed in device memory (and a forced routing, the layer's), those start
     * before the host sees the picks and the output is the same bytes. */
    {
        const uint32_t ne = s->n_expert;
        uint16_t *rw = rand_bf16((uint64_t)ne * dim, 0.05f);
        float *bias = malloc(sizeof(float) * ne), *logits = malloc(sizeof(float) * ne);
        for (uint32_t e = 0; e < ne; e++) bias[e] = (float)(rnd() % 5) * 0.01f;
        void *rwd = to_dev(c, rw, (size_t)ne * dim * 2), *bd = to_dev(c, bias, sizeof(float) * ne);
        const sl_moe_layer_w lw = {rw, bias, {NULL, NULL, NULL}};
        sl_moe_route rwant, rgot;
        cr_assert_eq(sl_router_route(L.x, &lw, s, logits, &rwant, &err), 0, "%s", err.msg);
        uint32_t started = 99, all[8];
        for (uint32_t k = 0; k < n_used; k++) all[k] = k;
        cr_assert_eq(sl_gpu_route_start(c, xd, rwd, bd, NULL, NULL, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_route_start(c, xd, rwd, bd, NULL, NULL, &err), SL_EINVAL);
        cr_assert_eq(sl_gpu_route_wait(c, &rgot, &started, &err), 0, "%s", err.msg);
        cr_assert_eq(started, 0u);
        for (uint32_t r = 0; r < n_used; r++) {
            cr_assert_eq(rgot.expert[r], rwant.expert[r], "rank %u: expert %u vs %u", r,
                         rgot.expert[r], rwant.expert[r]);
            cr_assert_eq(memcmp(&rgot.weight[r], &rwant.weight[r], 4), 0, "rank %u weight", r);
        }
        cr_assert_eq(sl_gpu_moe_part(c, all, n_used, w, &err), 0, "%s", err.msg);
        cr_assert_eq(sl_gpu_moe_finish(c, od, fd, &err), 0, "%s", err.msg);

        /* The same routing, not forced, with a device tier that holds the picks of even
         * rank, each with another device-resident expert's weights (the tier's entries
         * are what decides: distinct ones show an entry handed to the wrong rank), and
         * every other even expert: the picks are router.c's, the started ranks the even
         * ones, and the token (the odd ranks queued by the host, with their own weights)
         * gives the emulation's bytes with those weights. */
        {
            uint32_t dev[8], nd = 0;
            for (uint32_t k = 0; k < n_used; k++)
                if (!host[k]) dev[nd++] = k;
            cr_assert(nd > 0, "rank 0 is always placed in device memory");
            sl_gpu_t0e *tier = calloc(ne, sizeof *tier);
            for (uint32_t e = 0; e < ne; e += 2)
                tier[e] = (sl_gpu_t0e){w[0].gate, w[0].up, w[0].down};
            sl_moe_expert_w wr[8], lwr[8]; /* by rank: what the device and the host run */
            uint32_t want = 0, rest[8], nr = 0;
            for (uint32_t r = 0; r < n_used; r++) {
                const uint32_t e = rgot.expert[r];
                const uint32_t k = r % 2 ? r : dev[(r / 2) % nd];
                if (r % 2 == 0) {
                    tier[e] = (sl_gpu_t0e){w[k].gate, w[k].up, w[k].down};
                    want |= 1u << r;
                } else {
                    tier[e] = (sl_gpu_t0e){NULL, NULL, NULL};
                    rest[nr++] = r;
                }
                wr[r] = w[k];
                lwr[r] = L.w[k];
            }
            void *ed = to_dev(c, tier, sizeof *tier * ne);
            cr_assert_eq(sl_emu_moe(s, L.x, &rwant, lwr, &L.sh, eout, eyf, NULL, &err), 0, "%s",
                         err.msg);
            for (int rep = 0; rep < 2; rep++) { /* twice: the selection's scratch is reused */
                poison_dev(c, od, dim * 2);
                poison_dev(c, fd, dim * 4);
                cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
                cr_assert_eq(sl_gpu_route_start(c, xd, rwd, bd, ed, NULL, &err), 0, "%s", err.msg);
                cr_assert_eq(sl_gpu_route_wait(c, &rgot, &started, &err), 0, "%s", err.msg);
                for (uint32_t r = 0; r < n_used; r++) {
                    cr_assert_eq(rgot.expert[r], rwant.expert[r], "tier: rank %u: expert %u vs %u",
                                 r, rgot.expert[r], rwant.expert[r]);
                    cr_assert_eq(memcmp(&rgot.weight[r], &rwant.weight[r], 4), 0,
                                 "tier: rank %u weight", r);
                }
                cr_assert_eq(started, want, "tier: started 0x%x, want 0x%x", started, want);
                cr_assert_eq(sl_gpu_moe_part(c, rest, nr, wr, &err), 0, "%s", err.msg);
                cr_assert_eq(sl_gpu_moe_finish(c, od, fd, &err), 0, "%s", err.msg);
                cr_assert_eq(sl_gpu_download(c, gotf, fd, dim * 4, &err), 0, "%s", err.msg);
                cr_assert_eq(sl_gpu_download(c, got, od, dim * 2, &err), 0, "%s", err.msg);
                cr_assert_eq(memcmp(gotf, eyf, dim * 4), 0,
                             "tier, not forced (placement %s, started 0x%x): f32 differs", where,
                             started);
                cr_assert_eq(memcmp(got, eout, dim * 2), 0, "tier, not forced: bf16 differs");
            }
            sl_gpu_free(c, ed);
            free(tier);
        }

        sl_gpu_t0e *tab = calloc(ne, sizeof *tab);
        uint32_t want_started = 0;
        for (uint32_t k = 0; k < n_used; k++)
            if (!host[k]) {
                tab[L.route.expert[k]] = (sl_gpu_t0e){w[k].gate, w[k].up, w[k].down};
                want_started |= 1u << k;
            }
        void *td = to_dev(c, tab, sizeof *tab * ne);
        for (int pass = 0; pass < 2; pass++) {
            if (pass) { /* the table changes in stream order: drop rank 0's expert */
                const uint32_t idx = L.route.expert[0];
                const sl_gpu_t0e none = {NULL, NULL, NULL};
                cr_assert_eq(sl_gpu_t0_set(c, td, &idx, &none, 1, &err), 0, "%s", err.msg);
                want_started &= ~1u;
            }
            poison_dev(c, od, dim * 2);
            poison_dev(c, fd, dim * 4);
            cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_route_start(c, xd, rwd, bd, td, &L.route, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_route_wait(c, &rgot, &started, &err), 0, "%s", err.msg);
            cr_assert_eq(started, want_started, "started 0x%x, want 0x%x (placement %s)", started,
                         want_started, where);
            if (pass) cr_assert_eq(sl_gpu_moe_down_early(c, &err), 0, "%s", err.msg);
            uint32_t rest[8], nr = 0;
            for (uint32_t k = 0; k < n_used; k++) {
                cr_assert_eq(rgot.expert[k], L.route.expert[k]);
                if (!(started >> k & 1)) rest[nr++] = k;
            }
            cr_assert_eq(sl_gpu_moe_part(c, rest, nr, w, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_moe_finish(c, od, fd, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_download(c, got, od, dim * 2, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_download(c, gotf, fd, dim * 4, &err), 0, "%s", err.msg);
            cr_assert_eq(memcmp(gotf, onef, dim * 4), 0,
                         "device-routed pass %d (placement %s, "
                         "started 0x%x): f32 differs",
                         pass, where, started);
            cr_assert_eq(memcmp(got, one, dim * 2), 0, "device-routed pass %d: bf16 differs", pass);
        }
        /* Tokens back to back, nothing waited for between them but the picks: each has
         * its own x, other routing weights and, from the second on, another device-tier
         * table (one more pick in or out), so the gate/up reading an earlier token's
         * table or x shows. More tokens than the tagged table has tags (15), with the
         * number of its entries moving, so that an entry left from a selection with
         * the same tag would show too. */
        enum { NT = 36 };
        void *ot[NT], *ft[NT], *xt[NT];
        uint16_t *xh[NT];
        sl_moe_route fr[NT];
        uint32_t in_t0 = want_started; /* rank 0 is out since pass 1 */
        for (int t = 0; t < NT; t++) {
            cr_assert_eq(sl_gpu_malloc(c, &ot[t], dim * 2, &err), 0);
            cr_assert_eq(sl_gpu_malloc(c, &ft[t], dim * 4, &err), 0);
            poison_dev(c, ot[t], dim * 2);
            poison_dev(c, ft[t], dim * 4);
            fr[t] = L.route;
            for (uint32_t k = 0; k < n_used; k++) fr[t].weight[k] *= 1.0f + 0.125f * (float)t;
            xh[t] = rand_bf16(dim, 1.0f);
            xt[t] = to_dev(c, xh[t], dim * 2);
        }
        for (int t = 0; t < NT; t++) {
            const uint32_t k = (uint32_t)t % n_used; /* toggle rank k's expert in the tier */
            if (t > 0 && !host[k]) {
                const uint32_t idx = L.route.expert[k];
                const sl_gpu_t0e e = in_t0 >> k & 1 ? (sl_gpu_t0e){NULL, NULL, NULL}
                                                    : (sl_gpu_t0e){w[k].gate, w[k].up, w[k].down};
                cr_assert_eq(sl_gpu_t0_set(c, td, &idx, &e, 1, &err), 0, "%s", err.msg);
                in_t0 ^= 1u << k;
            }
            cr_assert_eq(sl_gpu_moe_shared(c, xt[t], &sh, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_route_start(c, xt[t], rwd, bd, td, &fr[t], &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_route_wait(c, &rgot, &started, &err), 0, "%s", err.msg);
            cr_assert_eq(started, in_t0, "token %d: started 0x%x, want 0x%x", t, started, in_t0);
            uint32_t rest[8], nr = 0;
            for (uint32_t q = 0; q < n_used; q++)
                if (!(started >> q & 1)) rest[nr++] = q;
            cr_assert_eq(sl_gpu_moe_part(c, rest, nr, w, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_moe_finish(c, ot[t], ft[t], &err), 0, "%s", err.msg);
        }
        for (int t = 0; t < NT; t++) {
            cr_assert_eq(sl_emu_moe(s, xh[t], &fr[t], L.w, &L.sh, eout, eyf, NULL, &err), 0, "%s",
                         err.msg);
            cr_assert_eq(sl_gpu_download(c, got, ot[t], dim * 2, &err), 0, "%s", err.msg);
            cr_assert_eq(sl_gpu_download(c, gotf, ft[t], dim * 4, &err), 0, "%s", err.msg);
            cr_assert_eq(memcmp(gotf, eyf, dim * 4), 0,
                         "back-to-back token %d (placement %s): f32 differs from the emulation", t,
                         where);
            cr_assert_eq(memcmp(got, eout, dim * 2), 0, "back-to-back token %d: bf16 differs", t);
            sl_gpu_free(c, ot[t]);
            sl_gpu_free(c, ft[t]);
            sl_gpu_free(c, xt[t]);
            free(xh[t]);
        }
        free(tab);
        free(rw);
        free(bias);
        free(logits);
        sl_gpu_free(c, rwd);
        sl_gpu_free(c, bd);
        sl_gpu_free(c, td);
    }

    /* misuse: a rank twice, finish before every rank, part before begin */
    const uint32_t r0 = 0;
    cr_assert_eq(sl_gpu_moe_begin(c, xd, &L.route, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_part(c, &r0, 1, w, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_part(c, &r0, 1, w, &err), SL_EINVAL);
    if (n_used > 1) cr_assert_eq(sl_gpu_moe_finish(c, od, fd, &err), SL_EINVAL);
    const uint32_t bad = n_used;
    cr_assert_eq(sl_gpu_moe_part(c, &bad, 1, w, &err), SL_EINVAL);
    cr_assert_eq(sl_gpu_sync(c, &err), 0, "%s", err.msg);
    printf("gpu split dim %u inter %u n %u placement %s: %d random splits (some with the "
           "queued experts' down early), the device-routed start (device tier = the 'd' "
           "experts) and 36 device-routed tokens back to back (other x, weights and tables) "
           "bit-exact with the one-shot call and the emulation; device picks = router.c's\n",
           dim, inter, n_used, where, trials);

    for (uint32_t k = 0; k < n_used; k++) unplace(c, keep[k], host[k]);
    unplace(c, keep[8], 0);
    sl_gpu_free(c, xd);
    sl_gpu_free(c, od);
    sl_gpu_free(c, fd);
    sl_gpu_close(&c);
    free(one);
    free(got);
    free(onef);
    free(gotf);
    free(eout);
    free(eyf);
    free_layer(&L);
}

Test(moe_gpu, split_hits_first, .timeout = 500)
{
    NEED_GPU();
    check_split(512, 256, 3, 6);
    check_split(1280, 768, 8, 6);
    check_split(5120, 2304, 6, 6);
}

Test(moe_gpu, rejects_bad_arguments)
{
    NEED_GPU();
    sl_err err = {0};
    sl_gpu_ctx *c = NULL;
    sl_moe_shape s = make_shape(500, 256, 2, 0);
    cr_assert_eq(sl_gpu_open(&c, 0, &s, &err), SL_EINVAL);
    cr_assert_null(c);
    s = make_shape(512, 256, 9, 0);
    cr_assert_eq(sl_gpu_open(&c, 0, &s, &err), SL_EINVAL);
    s = make_shape(512, 256, 2, 0);
    s.down_type = SL_QTYPE_Q4_K;
    cr_assert_eq(sl_gpu_open(&c, 0, &s, &err), SL_EUNSUPPORTED);
    s = make_shape(512, 256, 2, 0);
    cr_assert_eq(sl_gpu_open(&c, 0, &s, &err), 0, "%s", err.msg);
    sl_moe_route r = {{1, 2}, {0.5f, 0.5f}};
    sl_moe_expert_w w[2] = {{(void *)16, (void *)17, (void *)32},
                            {(void *)16, (void *)16, (void *)16}};
    void *out = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &out, 1024, &err), 0);
    cr_assert_eq(sl_gpu_moe_routed(c, out, &r, w, out, NULL, &err), SL_EINVAL);
    cr_assert(strstr(err.msg, "aligned"), "%s", err.msg);
    float logits[384];
    cr_assert_eq(sl_gpu_router_wait(c, logits, &err), SL_EINVAL, "a wait needs a start");
    cr_assert_eq(sl_gpu_residual_norm(c, NULL, NULL, NULL, 1e-6f, NULL, &err), SL_EINVAL);
    sl_gpu_free(c, out);
    sl_gpu_close(&c);
    cr_assert_null(c);
}

/* A token dropped half way (a part refused, a routing not waited for) leaves the
 * context refusing new routings until sl_gpu_moe_abort; after it, the next token's
 * bytes are the emulation's. */
Test(moe_gpu, abort_drops_the_token)
{
    NEED_GPU();
    layer L;
    make_layer(&L, 512, 256, 3, 0);
    const sl_moe_shape *s = &L.s;
    const uint32_t dim = s->dim;
    sl_err err = {0};
    uint16_t *eout = malloc(dim * 2), *got = malloc(dim * 2);
    float *eyf = malloc(dim * 4);
    cr_assert_eq(sl_emu_moe(s, L.x, &L.route, L.w, &L.sh, eout, eyf, NULL, &err), 0, "%s", err.msg);
    sl_gpu_ctx *c = open_gpu(s);
    void *keep[9][3];
    sl_moe_expert_w w[8];
    for (uint32_t k = 0; k < 3; k++) w[k] = place(c, &L.w[k], s, 0, k == 2, keep[k]);
    const sl_moe_expert_w sh = place(c, &L.sh, s, 0, 0, keep[8]);
    uint16_t *rw = rand_bf16((uint64_t)s->n_expert * dim, 0.05f);
    void *xd = to_dev(c, L.x, dim * 2), *rwd = to_dev(c, rw, (size_t)s->n_expert * dim * 2);
    void *od = NULL;
    cr_assert_eq(sl_gpu_malloc(c, &od, dim * 2, &err), 0);

    /* a part refused half way: the token stays open */
    cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_begin(c, xd, &L.route, &err), 0, "%s", err.msg);
    const uint32_t r0 = 0, r1 = 1;
    cr_assert_eq(sl_gpu_moe_part(c, &r0, 1, w, &err), 0, "%s", err.msg);
    sl_moe_expert_w bad[8];
    memcpy(bad, w, sizeof bad);
    bad[1].down = (const uint8_t *)w[1].down + 4; /* misaligned */
    cr_assert_eq(sl_gpu_moe_part(c, &r1, 1, bad, &err), SL_EINVAL);
    cr_assert_eq(sl_gpu_route_start(c, xd, rwd, NULL, NULL, NULL, &err), SL_EINVAL,
                 "a routing while a token is open");
    cr_assert_eq(sl_gpu_moe_abort(c, &err), 0, "%s", err.msg);

    /* a routing queued and never waited for */
    cr_assert_eq(sl_gpu_route_start(c, xd, rwd, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_abort(c, &err), 0, "%s", err.msg);
    sl_moe_route picked;
    uint32_t started = 0;
    cr_assert_eq(sl_gpu_route_start(c, xd, rwd, NULL, NULL, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_route_wait(c, &picked, &started, &err), 0, "%s", err.msg);
    cr_assert_eq(started, 0u);
    cr_assert_eq(sl_gpu_moe_abort(c, &err), 0, "%s", err.msg); /* those picks dropped too */

    /* the next token: the emulation's bytes (the shared expert queued before the
     * abort was dropped with it, so it is queued again) */
    poison_dev(c, od, dim * 2);
    cr_assert_eq(sl_gpu_moe_shared(c, xd, &sh, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_moe_routed(c, xd, &L.route, w, od, NULL, &err), 0, "%s", err.msg);
    cr_assert_eq(sl_gpu_download(c, got, od, dim * 2, &err), 0, "%s", err.msg);
    cr_assert_eq(memcmp(got, eout, dim * 2), 0, "the token after the aborts differs");

    for (uint32_t k = 0; k < 3; k++) unplace(c, keep[k], k == 2);
    unplace(c, keep[8], 0);
    sl_gpu_free(c, xd);
    sl_gpu_free(c, rwd);
    sl_gpu_free(c, od);
    sl_gpu_close(&c);
    free(rw);
    free(eout);
    free(got);
    free(eyf);
    free_layer(&L);
}
