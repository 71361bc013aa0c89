/* moe_fixture.h - test helpers shared by the CPU emulation tests and the GPU suite:
 * a seeded generator, random but valid Q2_K/Q3_K/BF16 weights (4096-aligned, so they
 * can be registered or copied as they are), block decoding, and a plain f32 reference
 * of one expert. Header-only: each test program includes it once. */
#ifndef SL_MOE_FIXTURE_H
#define SL_MOE_FIXTURE_H

#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_types.h"
#include "quant.h"

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static float urand(void)
{
    return (float)(rnd() >> 40) / 16777216.0f;
}

static float nrand(void)
{
    return (urand() + urand() + urand() + urand() - 2.0f) * 1.7320508f;
}

static void put_f16(uint8_t *p, float v)
{
    const sl_f16 h = sl_f32_to_f16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void *rand_blocks(uint32_t type, uint64_t n, float scale)
{
    const uint32_t bb = type == SL_QTYPE_Q2_K ? 84 : 110;
    uint8_t *p = aligned_alloc(4096, (n / 256 * bb + 4095) / 4096 * 4096);
    cr_assert(p);
    for (uint64_t b = 0; b < n / 256; b++) {
        uint8_t *blk = p + b * bb;
        for (uint32_t i = 0; i < bb; i += 8) {
            const uint64_t r = rnd();
            memcpy(blk + i, &r, bb - i < 8 ? bb - i : 8);
        }
        if (type == SL_QTYPE_Q2_K) {
            put_f16(blk + 80, scale * (0.5f + urand()));
            put_f16(blk + 82, scale * (0.5f + urand()));
        } else {
            put_f16(blk + 108, scale * (0.5f + urand()));
        }
    }
    return p;
}

static uint16_t *rand_bf16(uint64_t n, float scale)
{
    uint16_t *p = aligned_alloc(4096, (n * 2 + 4095) / 4096 * 4096);
    cr_assert(p);
    for (uint64_t i = 0; i < n; i++) p[i] = sl_f32_to_bf16(scale * nrand());
    return p;
}

static float *decode(uint32_t type, const void *src, uint64_t n)
{
    float *y = malloc(n * sizeof(float));
    cr_assert(y);
    cr_assert_eq(sl_quant_decode(type, src, y, n), 0);
    return y;
}

static void ref_expert(const sl_moe_shape *s, const float *x, const sl_moe_expert_w *w, int bf16,
                       float weight, float *y)
{
    const uint32_t dim = s->dim, inter = s->inter;
    const uint64_t n = (uint64_t)dim * inter;
    float *g = decode(bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q2_K, w->gate, n);
    float *u = decode(bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q2_K, w->up, n);
    float *d = decode(bf16 ? SL_QTYPE_BF16 : SL_QTYPE_Q3_K, w->down, n);
    float *h = malloc(inter * sizeof(float));
    for (uint32_t r = 0; r < inter; r++) {
        double a = 0, b = 0;
        for (uint32_t i = 0; i < dim; i++) {
            a += (double)g[(size_t)r * dim + i] * x[i];
            b += (double)u[(size_t)r * dim + i] * x[i];
        }
        float gv = sl_bf16_to_f32(sl_f32_to_bf16((float)a));
        float uv = sl_bf16_to_f32(sl_f32_to_bf16((float)b));
        uv = fminf(fmaxf(uv, -s->swiglu_limit), s->swiglu_limit);
        gv = fminf(gv, s->swiglu_limit);
        h[r] = sl_bf16_to_f32(sl_f32_to_bf16(gv / (1.0f + expf(-gv)) * uv * weight));
    }
    for (uint32_t r = 0; r < dim; r++) {
        double a = 0;
        for (uint32_t i = 0; i < inter; i++) a += (double)d[(size_t)r * inter + i] * h[i];
        y[r] = sl_bf16_to_f32(sl_f32_to_bf16((float)a));
    }
    free(g);
    free(u);
    free(d);
    free(h);
}

#endif
