/* test_quant.c - element types, f16/bf16 conversions, block decoders against
 * hand-built blocks, reference quantizers (error bounds, exact grids, parameters),
 * q8_1 activation semantics.
 *
 * Decoder tests build blocks byte by byte from chosen d/dmin/scales/codes, with the
 * packing written out here from the format descriptions, and compare against the
 * value formula computed here (plain f32 arithmetic on those chosen numbers, with f16
 * constants evaluated by ldexp), never through quant.c's own helpers.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "quant.h"

/* ------------------------------------------------------------------ helpers */

static uint32_t fbits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bitsf(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v & 0xff);
    p[1] = (uint8_t)(v >> 8);
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

/* Value of a finite half from its fields, independently of sl_f16_to_f32. */
static double half_value(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return (h & 0x8000) ? -v : v;
}

/* xorshift64: deterministic data for every run. */
typedef struct rng {
    uint64_t s;
} rng;

static float rng_uniform(rng *r) /* [-1, 1) */
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (float)((double)(r->s >> 40) * 0x1p-24 * 2 - 1);
}

static float rng_gauss(rng *r)
{
    float u1 = (rng_uniform(r) + 1) / 2 + 1e-7f, u2 = (rng_uniform(r) + 1) / 2;
    return sqrtf(-2 * logf(u1)) * cosf(6.2831853f * u2);
}

/* Bit-exact comparison of decoded values with the expected ones. */
static void expect_same(const float *got, const float *want, int n, const char *what)
{
    for (int i = 0; i < n; i++)
        cr_expect(fbits(got[i]) == fbits(want[i]), "%s: value %d is %.9g, want %.9g", what, i,
                  (double)got[i], (double)want[i]);
}

/* ------------------------------------------------------------------ type table */

Test(qtype, table)
{
    static const struct {
        uint32_t id;
        const char *name;
        uint32_t elems, bytes;
        int dec, enc;
    } want[] = {
        {SL_QTYPE_F32, "F32", 1, 4, 1, 1},       {SL_QTYPE_F16, "F16", 1, 2, 1, 1},
        {SL_QTYPE_Q4_0, "Q4_0", 32, 18, 1, 0},   {SL_QTYPE_Q4_1, "Q4_1", 32, 20, 1, 0},
        {SL_QTYPE_Q5_0, "Q5_0", 32, 22, 1, 0},   {SL_QTYPE_Q5_1, "Q5_1", 32, 24, 1, 0},
        {SL_QTYPE_Q8_0, "Q8_0", 32, 34, 1, 1},   {SL_QTYPE_Q8_1, "Q8_1", 32, 36, 0, 0},
        {SL_QTYPE_Q2_K, "Q2_K", 256, 84, 1, 1},  {SL_QTYPE_Q3_K, "Q3_K", 256, 110, 1, 1},
        {SL_QTYPE_Q4_K, "Q4_K", 256, 144, 1, 1}, {SL_QTYPE_Q5_K, "Q5_K", 256, 176, 1, 0},
        {SL_QTYPE_Q6_K, "Q6_K", 256, 210, 1, 1}, {SL_QTYPE_Q8_K, "Q8_K", 256, 292, 1, 0},
        {SL_QTYPE_I8, "I8", 1, 1, 0, 0},         {SL_QTYPE_I16, "I16", 1, 2, 0, 0},
        {SL_QTYPE_I32, "I32", 1, 4, 0, 0},       {SL_QTYPE_I64, "I64", 1, 8, 0, 0},
        {SL_QTYPE_F64, "F64", 1, 8, 0, 0},       {SL_QTYPE_BF16, "BF16", 1, 2, 1, 1},
    };
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        const sl_qtype_info *qi = sl_qtype_get(want[k].id);
        cr_assert_not_null(qi, "type %u unknown", want[k].id);
        cr_expect_str_eq(qi->name, want[k].name);
        cr_expect_eq(qi->block_elems, want[k].elems, "%s elems", want[k].name);
        cr_expect_eq(qi->block_bytes, want[k].bytes, "%s bytes", want[k].name);
        cr_expect_eq(qi->decodable, want[k].dec, "%s decodable", want[k].name);
        cr_expect_eq(qi->encodable, want[k].enc, "%s encodable", want[k].name);
    }
    /* removed (4, 5), IQ (16..23, 29), newer (31+) and absurd ids */
    static const uint32_t unknown[] = {4, 5, 16, 19, 23, 29, 31, 34, 39, 1000, UINT32_MAX};
    for (size_t k = 0; k < sizeof unknown / sizeof unknown[0]; k++)
        cr_expect_null(sl_qtype_get(unknown[k]), "type %u should be unknown", unknown[k]);

    cr_expect_eq(sizeof(sl_block_q8_0), 34);
    cr_expect_eq(sizeof(sl_block_q2_k), 84);
    cr_expect_eq(sizeof(sl_block_q3_k), 110);
    cr_expect_eq(sizeof(sl_block_q4_k), 144);
    cr_expect_eq(sizeof(sl_block_q5_k), 176);
    cr_expect_eq(sizeof(sl_block_q6_k), 210);
    cr_expect_eq(sizeof(sl_block_q8_1), 40);
}

Test(qtype, row_bytes)
{
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q2_K, 5120), 20 * 84);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q3_K, 2304), 9 * 110);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q6_K, 256), 210);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q8_0, 64), 68);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_F32, 3), 12);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_BF16, 5120), 10240);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_I64, 7), 56);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_F16, 0), 0);
    /* not whole blocks */
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q2_K, 255), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q2_K, 257), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q8_0, 48), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q4_K, 100), 0);
    /* unknown types */
    cr_expect_eq(sl_qtype_row_bytes(4, 32), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_COUNT, 256), 0);
    /* sizes past 64 bits (hostile headers) */
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_F32, UINT64_MAX / 2), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_Q8_K, UINT64_MAX / 256 * 256), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_F64, UINT64_MAX / 8 + 1), 0);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_F64, UINT64_MAX / 8), UINT64_MAX / 8 * 8);
    cr_expect_eq(sl_qtype_row_bytes(SL_QTYPE_I8, UINT64_MAX), UINT64_MAX);
}

/* ------------------------------------------------------------------ f16 / bf16 */

Test(f16, exhaustive_decode_and_round_trip)
{
    int n_nan = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = sl_f16_to_f32((sl_f16)h);
        int e = (h >> 10) & 31, m = h & 1023;
        if (e == 31 && m) {
            n_nan++;
            cr_assert(isnan(f), "half %04x is NaN, got %g", h, (double)f);
            uint16_t back = sl_f32_to_f16(f);
            cr_assert(((back >> 10) & 31) == 31 && (back & 1023), "NaN %04x -> %04x", h, back);
            cr_assert_eq(back & 0x8000, h & 0x8000, "NaN sign of %04x", h);
            continue;
        }
        if (e == 31) {
            cr_assert(isinf(f) && (signbit(f) != 0) == ((h & 0x8000) != 0), "inf %04x", h);
        } else {
            double want = half_value((uint16_t)h);
            cr_assert((double)f == want, "half %04x -> %.10g, want %.10g", h, (double)f, want);
            cr_assert_eq(signbit(f) != 0, (h & 0x8000) != 0, "sign of %04x", h);
        }
        uint16_t back = sl_f32_to_f16(f);
        cr_assert_eq(back, h, "round trip %04x -> %.10g -> %04x", h, (double)f, back);
    }
    cr_expect_eq(n_nan, 2 * 1023);
}

/* Every midpoint between two adjacent finite halves is exact in f32: it must go to
 * the even neighbour, and one f32 ulp either side must go to the nearer one. */
Test(f16, rne_at_every_midpoint)
{
    for (uint32_t h = 0; h < 0x7c00; h++) {
        for (int sgn = 0; sgn < 2; sgn++) {
            uint16_t lo = (uint16_t)(h | (sgn ? 0x8000 : 0)), hi = (uint16_t)(lo + 1);
            double a = half_value(lo);
            /* the neighbour past 65504 is the 65536 that the format rounds to inf */
            double b = (h == 0x7bff) ? (sgn ? -65536.0 : 65536.0) : half_value(hi);
            float mid = (float)((a + b) / 2);
            cr_assert((double)mid == (a + b) / 2, "midpoint of %04x not exact", lo);
            uint16_t even = (lo & 1) ? hi : lo;
            cr_assert_eq(sl_f32_to_f16(mid), even, "tie %.10g -> %04x, want %04x", (double)mid,
                         sl_f32_to_f16(mid), even);
            float toward_a = nextafterf(mid, (float)a), toward_b = nextafterf(mid, (float)b);
            cr_assert_eq(sl_f32_to_f16(toward_a), lo, "below tie at %04x", lo);
            cr_assert_eq(sl_f32_to_f16(toward_b), hi, "above tie at %04x", lo);
        }
    }
}

Test(f16, hand_values)
{
    static const struct {
        float f;
        uint16_t h;
    } v[] = {
        {1.0f, 0x3c00},
        {-2.0f, 0xc000},
        {1.0f / 3, 0x3555},                   /* 1.0101..b: 341.33 -> 341 */
        {1.0f + 0x1p-11f, 0x3c00},            /* tie, even is 1.0 */
        {1.0f + 3 * 0x1p-11f, 0x3c02},        /* tie, odd 0x3c01 loses */
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01}, /* just past the tie */
        {2049.0f, 0x6800},                    /* ulp 2 at 2048: tie to 2048 */
        {2051.0f, 0x6802},                    /* tie to 2052 */
        {65504.0f, 0x7bff},
        {65519.99f, 0x7bff},
        {65520.0f, 0x7c00}, /* tie between 65504 and 65536 (inf): even wins */
        {-65520.0f, 0xfc00},
        {1e10f, 0x7c00},
        {0x1p-14f, 0x0400},            /* smallest normal */
        {0x1p-14f - 0x1p-25f, 0x0400}, /* tie between 0x3ff and 0x400 */
        {0x1p-24f, 0x0001},            /* smallest subnormal */
        {0x1p-25f, 0x0000},            /* tie with zero */
        {0x1p-25f + 0x1p-40f, 0x0001}, /* past it */
        {3 * 0x1p-25f, 0x0002},        /* tie between 1 and 2 subnormal: 2 */
        {-5 * 0x1p-25f, 0x8002},       /* tie between 2 and 3: 2 */
        {1e-30f, 0x0000},
        {-0.0f, 0x8000},
        {0x1p-149f, 0x0000}, /* f32 subnormal */
    };
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++)
        cr_expect_eq(sl_f32_to_f16(v[k].f), v[k].h, "%.10g -> %04x, want %04x", (double)v[k].f,
                     sl_f32_to_f16(v[k].f), v[k].h);
    cr_expect_eq(sl_f32_to_f16(INFINITY), 0x7c00);
    cr_expect_eq(sl_f32_to_f16(-INFINITY), 0xfc00);
    uint16_t qn = sl_f32_to_f16(bitsf(0x7f800001)); /* signaling NaN, low payload */
    cr_expect(((qn >> 10) & 31) == 31 && (qn & 0x200), "sNaN -> %04x: want a quiet NaN", qn);
    cr_expect(sl_f32_to_f16(bitsf(0xffc00000)) & 0x8000, "NaN sign kept");
}

Test(bf16, values_and_ties)
{
    cr_expect_eq(fbits(sl_bf16_to_f32(0x3f80)), fbits(1.0f));
    cr_expect_eq(fbits(sl_bf16_to_f32(0xc000)), fbits(-2.0f));
    cr_expect_eq(fbits(sl_bf16_to_f32(0x4049)), fbits(3.140625f));
    cr_expect_eq(fbits(sl_bf16_to_f32(0x0001)), 0x00010000u); /* subnormal kept */
    cr_expect_eq(sl_f32_to_bf16(1.0f / 3), 0x3eab);           /* 0x3eaaaaab rounds up */
    cr_expect_eq(sl_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);     /* tie to even */
    cr_expect_eq(sl_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82); /* tie to even (up) */
    cr_expect_eq(sl_f32_to_bf16(-1.0f - 0x1p-8f - 0x1p-20f), 0xbf81);
    cr_expect_eq(sl_f32_to_bf16(bitsf(0x7f7fffff)), 0x7f80); /* FLT_MAX rounds to inf */
    cr_expect_eq(sl_f32_to_bf16(INFINITY), 0x7f80);
    cr_expect_eq(sl_f32_to_bf16(-0.0f), 0x8000);
    uint16_t n1 = sl_f32_to_bf16(bitsf(0x7f800001)); /* truncation would give inf */
    cr_expect(n1 != 0x7f80 && (n1 & 0x7f80) == 0x7f80 && (n1 & 0x7f), "NaN -> %04x", n1);
    cr_expect_eq(sl_f32_to_bf16(bitsf(0xff800001)) & 0x8000, 0x8000, "NaN sign kept");

    /* every bf16 round-trips; every midpoint of adjacent finite values (exact in f32)
     * goes to the even one, one f32 ulp either side to the nearer one */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = sl_bf16_to_f32((sl_bf16)h);
        if (isnan(f)) continue;
        cr_assert_eq(sl_f32_to_bf16(f), h, "round trip %04x", h);
        if ((h & 0x7fff) >= 0x7f7f) continue; /* no finite neighbour above (FLT_MAX: above) */
        uint16_t lo = (uint16_t)h, hi = (uint16_t)(h + 1);
        float a = f, b = sl_bf16_to_f32(hi);
        double mid = ((double)a + (double)b) / 2;
        float fm = (float)mid;
        cr_assert((double)fm == mid, "midpoint above %04x not exact", h);
        uint16_t even = (lo & 1) ? hi : lo;
        cr_assert_eq(sl_f32_to_bf16(fm), even, "tie above %04x", h);
        cr_assert_eq(sl_f32_to_bf16(nextafterf(fm, a)), lo, "below tie above %04x", h);
        cr_assert_eq(sl_f32_to_bf16(nextafterf(fm, 2 * fm)), hi, "past tie above %04x", h);
    }
}

/* ------------------------------------------------------------------ decoders */

Test(decode, f32_f16_bf16)
{
    uint8_t raw[8];
    float one = 1.5f, two = -0.0f, out[4];
    memcpy(raw, &one, 4);
    memcpy(raw + 4, &two, 4);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_F32, raw, out, 2), 0);
    cr_expect_eq(fbits(out[0]), fbits(1.5f));
    cr_expect_eq(fbits(out[1]), 0x80000000u);

    uint8_t h[9]; /* odd offset: decoders need no alignment */
    put16(h + 1, 0x3c00);
    put16(h + 3, 0xc500); /* -5 */
    put16(h + 5, 0x0001); /* 2^-24 */
    put16(h + 7, 0x7c00);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_F16, h + 1, out, 4), 0);
    cr_expect_eq(out[0], 1.0f);
    cr_expect_eq(out[1], -5.0f);
    cr_expect_eq(out[2], 0x1p-24f);
    cr_expect(isinf(out[3]) && out[3] > 0);

    put16(h + 1, 0x3f80);
    put16(h + 3, 0xc0a0); /* -5 */
    put16(h + 5, 0x4049);
    put16(h + 7, 0xff80);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_BF16, h + 1, out, 4), 0);
    cr_expect_eq(out[0], 1.0f);
    cr_expect_eq(out[1], -5.0f);
    cr_expect_eq(out[2], 3.140625f);
    cr_expect(isinf(out[3]) && out[3] < 0);
}

Test(decode, q8_0)
{
    /* two blocks: d = 0.5 with codes j - 16, then d = 0x2e66 with codes (j*9)%256-128 */
    uint8_t raw[2 * 34];
    float want[64], got[64];
    const uint16_t dh[2] = {0x3800, 0x2e66};
    cr_assert_eq(half_value(0x2e66), 1638.0 / 16384); /* 0.0999755859375 */
    for (int b = 0; b < 2; b++) {
        uint8_t *p = raw + 34 * b;
        put16(p, dh[b]);
        for (int j = 0; j < 32; j++) {
            int q = b == 0 ? j - 16 : (j * 9) % 256 - 128;
            p[2 + j] = (uint8_t)(int8_t)q;
            want[32 * b + j] = (float)q * (float)half_value(dh[b]);
        }
    }
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q8_0, raw, got, 64), 0);
    expect_same(got, want, 64, "q8_0");
    cr_expect_eq(got[0], -8.0f); /* -16 * 0.5 */
    cr_expect_eq(got[31], 7.5f);
    cr_expect_eq(got[32], -12.7968750f); /* -128 * 1638/16384 */
}

/* Q2_K, built from the layout: value i has code c at bits 2*((i%128)/32) of
 * qs[32*(i/128) + i%32]; sub-block k = i/16 has scale k and min 15-k in scales[k]. */
static void build_q2_k(uint8_t raw[84], float want[256], uint16_t dh, uint16_t mh, int salt)
{
    memset(raw, 0, 84);
    for (int k = 0; k < 16; k++) raw[k] = (uint8_t)(((k + salt) & 15) | (15 - k) << 4);
    const float d = (float)half_value(dh), dmin = (float)half_value(mh);
    for (int i = 0; i < 256; i++) {
        int c = (i * 7 + (i >> 4) + salt) & 3;
        raw[16 + 32 * (i / 128) + i % 32] |= (uint8_t)(c << (2 * ((i % 128) / 32)));
        int k = i / 16;
        float dl = d * (float)((k + salt) & 15), ml = dmin * (float)(15 - k);
        want[i] = dl * (float)c - ml;
    }
    put16(raw + 80, dh);
    put16(raw + 82, mh);
}

Test(decode, q2_k)
{
    uint8_t raw[2 * 84];
    float want[512], got[512];
    build_q2_k(raw, want, 0x3800, 0x3400, 0); /* d 0.5, dmin 0.25 */
    build_q2_k(raw + 84, want + 256, 0x2e66, 0x2a66, 5);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q2_K, raw, got, 512), 0);
    expect_same(got, want, 512, "q2_k");
    /* by hand, first block: value 0 (k 0: scale 0, min 15, code 0): -0.25*15 */
    cr_expect_eq(got[0], -3.75f);
    /* value 37: k 2 (scale 2, min 13), code (259 + 2) & 3 = 1 at bits 2..3 of qs[5]:
     * 0.5*2*1 - 0.25*13 */
    cr_expect_eq(got[37], -2.25f);
    /* value 179: k 11 (scale 11, min 4), code (1253 + 11) & 3 = 0 at bits 2..3 of qs[51] */
    cr_expect_eq(got[179], -1.0f);
    /* value 230: k 14 (14, 1), code (1610 + 14) & 3 = 0 */
    cr_expect_eq(got[230], -0.25f);
    /* value 95: k 5 (5, 10), code (665 + 5) & 3 = 2 at bits 4..5 of qs[31]: 5 - 2.5 */
    cr_expect_eq(got[95], 2.5f);
}

/* Q3_K: signed scale s_k = (5k % 64) - 32 stored +32 (low nibble in scales[k] or the
 * high nibble of scales[k-8], top 2 bits at bit 2*(k/4) of scales[8 + k%4]); code
 * c in -4..3: low 2 bits (c+4)&3 as in Q2_K, hmask[i%32] bit i/32 set iff c >= 0. */
static void build_q3_k(uint8_t raw[110], float want[256], uint16_t dh, int salt)
{
    memset(raw, 0, 110);
    uint8_t *hmask = raw, *qs = raw + 32, *sc = raw + 96;
    int s[16];
    for (int k = 0; k < 16; k++) {
        int u = (5 * k + salt) % 64;
        s[k] = u - 32;
        if (k < 8)
            sc[k] |= (uint8_t)(u & 15);
        else
            sc[k - 8] |= (uint8_t)((u & 15) << 4);
        sc[8 + k % 4] |= (uint8_t)((u >> 4) << (2 * (k / 4)));
    }
    const float d = (float)half_value(dh);
    for (int i = 0; i < 256; i++) {
        int c = (i * 3 + (i >> 5) + salt) % 8 - 4;
        int u = c + 4;
        qs[32 * (i / 128) + i % 32] |= (uint8_t)((u & 3) << (2 * ((i % 128) / 32)));
        if (u & 4) hmask[i % 32] |= (uint8_t)(1 << (i / 32));
        want[i] = d * (float)s[i / 16] * (float)c;
    }
    put16(raw + 108, dh);
}

Test(decode, q3_k)
{
    uint8_t raw[2 * 110];
    float want[512], got[512];
    build_q3_k(raw, want, 0x3400, 0); /* d 0.25 */
    build_q3_k(raw + 110, want + 256, 0x2e66, 11);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q3_K, raw, got, 512), 0);
    expect_same(got, want, 512, "q3_k");
    /* value 0: scale 0 - 32, code 0 - 4 (low bits 0, hmask bit clear): 0.25*-32*-4 */
    cr_expect_eq(got[0], 32.0f);
    /* value 1: code 3 - 4 = -1 (low bits 3, hmask clear) */
    cr_expect_eq(got[1], 8.0f);
    /* value 2: code 2 (low bits 2, hmask set) */
    cr_expect_eq(got[2], -16.0f);
    /* value 200: k 12, u = 60 (low nibble 12 in scales[4] >> 4, top bits 3 at bits
     * 6..7 of scales[8]): s = 28; c = (600 + 6) % 8 - 4 = 2: 0.25*28*2 */
    cr_expect_eq(got[200], 14.0f);
}

/* Q4_K/Q5_K scales: 6-bit sc[8], m[8]. j < 4: low 6 bits of bytes j and j+4; j >= 4:
 * low nibbles in byte j+4, top 2 bits in bits 6..7 of bytes j-4 (scale) and j (min). */
static void pack_k4_scales(uint8_t s[12], const int sc[8], const int m[8])
{
    memset(s, 0, 12);
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
        s[j + 8] = (uint8_t)((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
    }
}

static const int k4_sc[8] = {1, 63, 17, 32, 5, 48, 33, 62};
static const int k4_m[8] = {0, 7, 63, 16, 40, 3, 31, 60};

static void build_q4_k(uint8_t raw[144], float want[256], uint16_t dh, uint16_t mh, int salt)
{
    memset(raw, 0, 144);
    put16(raw, dh);
    put16(raw + 2, mh);
    pack_k4_scales(raw + 4, k4_sc, k4_m);
    const float d = (float)half_value(dh), dmin = (float)half_value(mh);
    for (int i = 0; i < 256; i++) {
        int c = (i * 5 + (i >> 5) + salt) & 15, j = i / 32;
        raw[16 + 32 * (i / 64) + i % 32] |= (uint8_t)(c << (4 * ((i % 64) / 32)));
        want[i] = d * (float)k4_sc[j] * (float)c - dmin * (float)k4_m[j];
    }
}

Test(decode, q4_k)
{
    uint8_t raw[2 * 144];
    float want[512], got[512];
    build_q4_k(raw, want, 0x3000, 0x2c00, 0); /* d 0.125, dmin 0.0625 */
    build_q4_k(raw + 144, want + 256, 0x2e66, 0x2a66, 3);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q4_K, raw, got, 512), 0);
    expect_same(got, want, 512, "q4_k");
    /* value 0: sub-block 0 (sc 1, m 0), code 0 */
    cr_expect_eq(got[0], 0.0f);
    /* value 33: sub-block 1 (sc 63, m 7), code (165 + 1) & 15 = 6, high nibble of qs[1]:
     * 0.125*63*6 - 0.0625*7 */
    cr_expect_eq(got[33], 46.8125f);
    /* value 250: sub-block 7 (sc 62 = 0b111110: nibble 14 in byte 11, top bits 3 in
     * byte 3; m 60 = 0b111100: nibble 12 in byte 11 high, top bits 3 in byte 7),
     * code (1250 + 7) & 15 = 9: 0.125*62*9 - 0.0625*60 */
    cr_expect_eq(got[250], 66.0f);
}

static void build_q5_k(uint8_t raw[176], float want[256], uint16_t dh, uint16_t mh, int salt)
{
    memset(raw, 0, 176);
    put16(raw, dh);
    put16(raw + 2, mh);
    pack_k4_scales(raw + 4, k4_sc, k4_m);
    uint8_t *qh = raw + 16, *qs = raw + 48;
    const float d = (float)half_value(dh), dmin = (float)half_value(mh);
    for (int i = 0; i < 256; i++) {
        int c = (i * 11 + (i >> 5) + salt) & 31, j = i / 32;
        qs[32 * (i / 64) + i % 32] |= (uint8_t)((c & 15) << (4 * ((i % 64) / 32)));
        if (c & 16) qh[i % 32] |= (uint8_t)(1 << (i / 32));
        want[i] = d * (float)k4_sc[j] * (float)c - dmin * (float)k4_m[j];
    }
}

Test(decode, q5_k)
{
    uint8_t raw[2 * 176];
    float want[512], got[512];
    build_q5_k(raw, want, 0x3000, 0x2c00, 0);
    build_q5_k(raw + 176, want + 256, 0x2e66, 0x2a66, 9);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q5_K, raw, got, 512), 0);
    expect_same(got, want, 512, "q5_k");
    /* value 3: sub-block 0 (sc 1, m 0), code 33 & 31 = 1: 0.125 */
    cr_expect_eq(got[3], 0.125f);
    /* value 66: sub-block 2 (sc 17, m 63), code (726 + 2) & 31 = 24 (qh bit set):
     * 0.125*17*24 - 0.0625*63 */
    cr_expect_eq(got[66], 47.0625f);
}

/* Q6_K: value i = 128h + 32g + l: code u (0..63) low nibble at nibble g/2 of
 * ql[64h + 32(g%2) + l], high 2 bits at bits 2g of qh[32h + l]; int8 scale per 16. */
static void build_q6_k(uint8_t raw[210], float want[256], uint16_t dh, int salt)
{
    memset(raw, 0, 210);
    uint8_t *ql = raw, *qh = raw + 128;
    int8_t s[16];
    for (int k = 0; k < 16; k++) {
        s[k] = (int8_t)((k * 37 + salt) % 256 - 128);
        raw[192 + k] = (uint8_t)s[k];
    }
    put16(raw + 208, dh);
    const float d = (float)half_value(dh);
    for (int i = 0; i < 256; i++) {
        int c = (i * 13 + (i >> 6) + salt) % 64 - 32, u = c + 32;
        int h = i / 128, g = (i % 128) / 32, l = i % 32;
        ql[64 * h + 32 * (g % 2) + l] |= (uint8_t)((u & 15) << (4 * (g / 2)));
        qh[32 * h + l] |= (uint8_t)((u >> 4) << (2 * g));
        want[i] = d * (float)s[i / 16] * (float)c;
    }
}

Test(decode, q6_k)
{
    uint8_t raw[2 * 210];
    float want[512], got[512];
    build_q6_k(raw, want, 0x3000, 0); /* d 0.125 */
    build_q6_k(raw + 210, want + 256, 0x2e66, 77);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q6_K, raw, got, 512), 0);
    expect_same(got, want, 512, "q6_k");
    /* value 0: scale -128, code -32: 0.125 * -128 * -32 */
    cr_expect_eq(got[0], 512.0f);
    /* value 100 (h 0, g 3, l 4): scale k 6 = 222 - 128 = 94, code (1300 + 1) % 64 - 32 =
     * -11 (u 21: low nibble 5 in the high half of ql[36], high bits 1 at bits 6..7 of
     * qh[4]): 0.125 * 94 * -11 */
    cr_expect_eq(got[100], -129.25f);
}

Test(decode, q4_0_q4_1_q5_0_q5_1_q8_k)
{
    uint8_t raw[292];
    float got[256], want[256];

    /* Q4_0: d = 0.5; value j low nibble of qs[j], value j+16 high nibble; minus 8 */
    memset(raw, 0, sizeof raw);
    put16(raw, 0x3800);
    for (int j = 0; j < 16; j++) raw[2 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        want[j] = (float)(j - 8) * 0.5f;
        want[j + 16] = (float)(7 - j) * 0.5f;
    }
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q4_0, raw, got, 32), 0);
    expect_same(got, want, 32, "q4_0");
    cr_expect_eq(got[0], -4.0f);

    /* Q4_1: d = 0.25, m = -1 */
    put16(raw + 2, 0xbc00);
    for (int j = 0; j < 16; j++) raw[4 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        want[j] = (float)j * 0.25f + -1.0f;
        want[j + 16] = (float)(15 - j) * 0.25f + -1.0f;
    }
    put16(raw, 0x3400);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q4_1, raw, got, 32), 0);
    expect_same(got, want, 32, "q4_1");
    cr_expect_eq(got[16], 2.75f);

    /* Q5_0: d = 0.5; fifth bit of value j is bit j of the little-endian qh word; set it
     * for odd values: code = nibble | 16*odd, minus 16 */
    memset(raw, 0, sizeof raw);
    put16(raw, 0x3800);
    raw[2] = raw[3] = raw[4] = raw[5] = 0xaa;
    for (int j = 0; j < 16; j++) raw[6 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        want[j] = (float)((j | (j & 1) << 4) - 16) * 0.5f;
        want[j + 16] = (float)(((15 - j) | ((j + 16) & 1) << 4) - 16) * 0.5f;
    }
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q5_0, raw, got, 32), 0);
    expect_same(got, want, 32, "q5_0");
    cr_expect_eq(got[1], 0.5f); /* 1 | 16 = 17, minus 16 */

    /* Q5_1: d = 0.5, m = 2, fifth bits 0xff000000: values 24..31 */
    memset(raw, 0, sizeof raw);
    put16(raw, 0x3800);
    put16(raw + 2, 0x4000);
    raw[7] = 0xff;
    for (int j = 0; j < 16; j++) raw[8 + j] = (uint8_t)(j | j << 4);
    for (int j = 0; j < 32; j++) want[j] = (float)((j % 16) | (j >= 24) << 4) * 0.5f + 2.0f;
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q5_1, raw, got, 32), 0);
    expect_same(got, want, 32, "q5_1");
    cr_expect_eq(got[31], 17.5f); /* (15 + 16) * 0.5 + 2 */

    /* Q8_K: f32 d then 256 int8 codes (bsums ignored) */
    memset(raw, 0, sizeof raw);
    float d = 0.1f;
    memcpy(raw, &d, 4);
    for (int j = 0; j < 256; j++) {
        raw[4 + j] = (uint8_t)(int8_t)(j - 128);
        want[j] = 0.1f * (float)(j - 128);
    }
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q8_K, raw, got, 256), 0);
    expect_same(got, want, 256, "q8_k");
}

Test(decode, rejects)
{
    static uint8_t raw[4096];
    float out[600];
    for (int i = 0; i < 600; i++) out[i] = 42.0f;
    static const uint32_t k_types[] = {SL_QTYPE_Q2_K, SL_QTYPE_Q3_K, SL_QTYPE_Q4_K,
                                       SL_QTYPE_Q5_K, SL_QTYPE_Q6_K, SL_QTYPE_Q8_K};
    for (size_t k = 0; k < sizeof k_types / sizeof k_types[0]; k++) {
        cr_expect_eq(sl_quant_decode(k_types[k], raw, out, 255), SL_EINVAL);
        cr_expect_eq(sl_quant_decode(k_types[k], raw, out, 257), SL_EINVAL);
        cr_expect_eq(sl_quant_decode(k_types[k], raw, out, 384), SL_EINVAL);
        cr_expect_eq(sl_quant_decode(k_types[k], NULL, out, 256), SL_EINVAL);
        cr_expect_eq(sl_quant_decode(k_types[k], raw, NULL, 256), SL_EINVAL);
        cr_expect_eq(sl_quant_decode(k_types[k], raw, out, 0), 0);
    }
    cr_expect_eq(sl_quant_decode(SL_QTYPE_Q8_0, raw, out, 33), SL_EINVAL);
    cr_expect_eq(sl_quant_decode(SL_QTYPE_Q4_0, raw, out, 16), SL_EINVAL);
    cr_expect_eq(sl_quant_decode(4, raw, out, 32), SL_EINVAL);    /* unknown */
    cr_expect_eq(sl_quant_decode(1000, raw, out, 32), SL_EINVAL); /* unknown */
    cr_expect_eq(sl_quant_decode(SL_QTYPE_I8, raw, out, 32), SL_EINVAL);
    cr_expect_eq(sl_quant_decode(SL_QTYPE_Q8_1, raw, out, 32), SL_EINVAL);
    for (int i = 0; i < 600; i++) cr_assert_eq(out[i], 42.0f, "dst touched at %d", i);
}

/* ------------------------------------------------------------------ quantizers */

#define NB     16             /* super-blocks per data set */
#define NV     (NB * SL_QK_K) /* values per data set */
#define N_SETS 11

/* The data sets every encodable type goes through: random (uniform, gaussian,
 * weight-sized, heavy-tailed, large) and edge cases (zeros, constants, one outlier per
 * block, negative-only, positive-only, tiny). */
static const char *make_set(int set, float *x)
{
    rng r = {0x9e3779b97f4a7c15ull + (uint64_t)set};
    for (int i = 0; i < NV; i++) {
        switch (set) {
        case 0:
            x[i] = rng_uniform(&r);
            break;
        case 1:
            x[i] = rng_gauss(&r);
            break;
        case 2:
            x[i] = 0.02f * rng_gauss(&r);
            break;
        case 3:
            x[i] = rng_gauss(&r) * rng_gauss(&r) * rng_gauss(&r);
            break;
        case 4:
            x[i] = 1000.0f * rng_uniform(&r);
            break;
        case 5:
            x[i] = 0.0f;
            break;
        case 6:
            x[i] = (i / SL_QK_K) % 2 ? 0.75f : -3.5f;
            break;
        case 7:
            x[i] = i % SL_QK_K == 77 ? 10.0f : 0.01f * rng_uniform(&r);
            break;
        case 8:
            x[i] = -0.5f - (rng_uniform(&r) + 1) / 2;
            break;
        case 9:
            x[i] = 0.25f + (rng_uniform(&r) + 1) / 2;
            break;
        case 10:
            x[i] = 1e-3f * rng_uniform(&r);
            break;
        }
    }
    static const char *names[N_SETS] = {"uniform",  "gauss",    "gauss*0.02", "heavy",
                                        "x1000",    "zeros",    "constants",  "outlier",
                                        "negative", "positive", "tiny"};
    return names[set];
}

/* Per-block error bounds, relative to the block's largest magnitude amax:
 *   Q8_0 (per 32): max |err| <= d/2 + 127*max(d*2^-11, 2^-25) + 2^-20*amax with
 *        d = amax/127: half a step from rounding, plus the f16 rounding of d (2^-11
 *        relative, or 2^-25 absolute when d is an f16 subnormal) times the largest
 *        code, plus f32 rounding. A hard bound: 0.0045*amax for normal d.
 *   K-quants (per 256): RMS error <= rms*amax and max error <= max*amax, where rms
 *        is a little above a uniform quantizer's step/sqrt(12) over the whole range
 *        (the worst case; scale searches only do better on real data) and max allows
 *        the clipping that the searches pick on purpose (trial scales that cut the
 *        extremes). Measured worst cases over 2000 random blocks are in brackets.
 *        Q2_K: 4 levels over up to 2*amax: step/sqrt(12) = 0.19 [0.152]; clip 0.42 ->
 *              rms 0.20, max 0.50.
 *        Q3_K: 8 levels, step amax/4: 0.072 [0.083 with 6-bit scales] -> 0.10, 0.35.
 *        Q4_K: 16 levels over up to 2*amax: 0.038 [0.034]; clip 0.117 -> 0.045, 0.16.
 *        Q6_K: 64 levels, step amax/32: 0.009 [0.0085], max step/2 + 8-bit scale
 *              quantization (amax/256) [0.024] -> 0.011, 0.03.
 *        Each bound also gets an absolute term kabs*2^-25: below 2^-14 the f16
 *        super-scales d and dmin are subnormal and carry an absolute rounding of up to
 *        2^-25, multiplied by the largest scale*code (and min) of the format: Q2_K
 *        15*3 + 15, Q3_K 32*4, Q4_K 63*15 + 63, Q6_K 128*32. Only the "tiny" set
 *        (amax 1e-3) needs it, where Q6_K's d = amax/4096 is an f16 subnormal.
 * Structure: every decoded value must also be the level of its sub-block nearest to
 * the input (the reference re-picks codes against the stored scales), up to f32
 * rounding; this catches packing mistakes that error bounds alone might miss. */
typedef struct kbound {
    uint32_t type;
    double rms, max; /* relative to amax */
    double kabs;     /* times 2^-25, absolute */
} kbound;

static const kbound k_bounds[] = {
    {SL_QTYPE_Q2_K, 0.20, 0.50, 60},
    {SL_QTYPE_Q3_K, 0.10, 0.35, 128},
    {SL_QTYPE_Q4_K, 0.045, 0.16, 1008},
    {SL_QTYPE_Q6_K, 0.011, 0.03, 4096},
};

/* Distance from x to the nearest level of sub-block `sub` of block raw, from the test's
 * own reading of the layout. */
static double nearest_level_dist(uint32_t type, const uint8_t *raw, int i, double x)
{
    double best = INFINITY;
    switch (type) {
    case SL_QTYPE_Q2_K: {
        double d = half_value(get16(raw + 80)), dmin = half_value(get16(raw + 82));
        int s = raw[i / 16];
        for (int q = 0; q <= 3; q++)
            best = fmin(best, fabs(d * (s & 15) * q - dmin * (s >> 4) - x));
        break;
    }
    case SL_QTYPE_Q3_K: {
        const uint8_t *sc = raw + 96;
        int k = i / 16;
        int lo = k < 8 ? sc[k] & 15 : sc[k - 8] >> 4;
        int s = (lo | ((sc[8 + k % 4] >> (2 * (k / 4))) & 3) << 4) - 32;
        double d = half_value(get16(raw + 108));
        for (int q = -4; q <= 3; q++) best = fmin(best, fabs(d * s * q - x));
        break;
    }
    case SL_QTYPE_Q4_K: {
        const uint8_t *s = raw + 4;
        int j = i / 32, sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
            m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        }
        double d = half_value(get16(raw)), dmin = half_value(get16(raw + 2));
        for (int q = 0; q <= 15; q++) best = fmin(best, fabs(d * sc * q - dmin * m - x));
        break;
    }
    case SL_QTYPE_Q6_K: {
        double d = half_value(get16(raw + 208));
        int s = (int8_t)raw[192 + i / 16];
        for (int q = -32; q <= 31; q++) best = fmin(best, fabs(d * s * q - x));
        break;
    }
    }
    return best;
}

/* The reference's normalisation of scales: the largest sub-block scale (and min)
 * takes the top code. True of every block the reference writes. */
static void expect_reference_scales(uint32_t type, const uint8_t *raw, const char *what)
{
    switch (type) {
    case SL_QTYPE_Q2_K: {
        int max_s = 0, max_m = 0;
        for (int k = 0; k < 16; k++) {
            if ((raw[k] & 15) > max_s) max_s = raw[k] & 15;
            if ((raw[k] >> 4) > max_m) max_m = raw[k] >> 4;
        }
        if (get16(raw + 80)) cr_expect_eq(max_s, 15, "%s: q2_K top scale %d", what, max_s);
        if (get16(raw + 82)) cr_expect_eq(max_m, 15, "%s: q2_K top min %d", what, max_m);
        break;
    }
    case SL_QTYPE_Q3_K: {
        int has_m32 = 0;
        const uint8_t *sc = raw + 96;
        for (int k = 0; k < 16; k++) {
            int lo = k < 8 ? sc[k] & 15 : sc[k - 8] >> 4;
            if ((lo | ((sc[8 + k % 4] >> (2 * (k / 4))) & 3) << 4) == 0) has_m32 = 1;
        }
        if (get16(raw + 108)) cr_expect(has_m32, "%s: q3_K has no scale at -32", what);
        break;
    }
    case SL_QTYPE_Q4_K: {
        int max_s = 0, max_m = 0;
        const uint8_t *s = raw + 4;
        for (int j = 0; j < 8; j++) {
            int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
            int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
            if (sc > max_s) max_s = sc;
            if (m > max_m) max_m = m;
        }
        if (get16(raw)) cr_expect_eq(max_s, 63, "%s: q4_K top scale %d", what, max_s);
        if (get16(raw + 2)) cr_expect_eq(max_m, 63, "%s: q4_K top min %d", what, max_m);
        break;
    }
    case SL_QTYPE_Q6_K: {
        int has_m128 = 0;
        for (int k = 0; k < 16; k++) has_m128 |= (int8_t)raw[192 + k] == -128;
        if (get16(raw + 208)) cr_expect(has_m128, "%s: q6_K has no scale at -128", what);
        break;
    }
    }
}

Test(encode, k_quants_error_bounds_and_structure)
{
    float *x = malloc(NV * sizeof *x), *y = malloc(NV * sizeof *y);
    uint8_t *q = malloc(NV * 4);
    cr_assert(x && y && q);
    for (size_t t = 0; t < sizeof k_bounds / sizeof k_bounds[0]; t++) {
        const kbound *kb = &k_bounds[t];
        const uint32_t bb = sl_qtype_get(kb->type)->block_bytes;
        for (int set = 0; set < N_SETS; set++) {
            const char *name = make_set(set, x);
            memset(q, 0xa5, NV * 4);
            cr_assert_eq(sl_quant_encode(kb->type, x, q, NV), 0);
            cr_assert_eq(sl_quant_decode(kb->type, q, y, NV), 0);
            for (int b = 0; b < NB; b++) {
                const float *xb = x + b * SL_QK_K, *yb = y + b * SL_QK_K;
                const uint8_t *raw = q + (size_t)b * bb;
                double amax = 0, se = 0, emax = 0;
                for (int i = 0; i < SL_QK_K; i++) amax = fmax(amax, fabs(xb[i]));
                for (int i = 0; i < SL_QK_K; i++) {
                    double e = fabs((double)yb[i] - xb[i]);
                    se += e * e;
                    emax = fmax(emax, e);
                    double near = nearest_level_dist(kb->type, raw, i, xb[i]);
                    cr_expect(e <= near + 1e-6 * amax + 1e-30,
                              "%s %s block %d value %d: %.9g -> %.9g, a level is %.3g away",
                              sl_qtype_get(kb->type)->name, name, b, i, (double)xb[i],
                              (double)yb[i], near);
                }
                double rms = sqrt(se / SL_QK_K), abs_term = kb->kabs * 0x1p-25;
                cr_expect(rms <= kb->rms * amax + abs_term,
                          "%s %s block %d: rms %.4g > %.3g * amax %.4g",
                          sl_qtype_get(kb->type)->name, name, b, rms, kb->rms, amax);
                cr_expect(emax <= kb->max * amax + abs_term,
                          "%s %s block %d: max %.4g > %.3g * amax %.4g",
                          sl_qtype_get(kb->type)->name, name, b, emax, kb->max, amax);
                if (amax == 0) cr_expect_eq(emax, 0.0, "zeros must decode to zeros");
                /* constants: one f16 rounding of d (and dmin) per level, 2^-11 each,
                 * times the largest code over the scale's range: a few 2^-11 */
                if (set == 6) cr_expect(emax <= 4 * 0x1p-11 * amax, "constant: err %.3g", emax);
                expect_reference_scales(kb->type, raw, name);
            }
        }
    }
    free(x);
    free(y);
    free(q);
}

Test(encode, q8_0_f16_bf16_f32_error_bounds)
{
    float *x = malloc(NV * sizeof *x), *y = malloc(NV * sizeof *y);
    uint8_t *q = malloc(NV * 4);
    cr_assert(x && y && q);
    for (int set = 0; set < N_SETS; set++) {
        const char *name = make_set(set, x);
        cr_assert_eq(sl_quant_encode(SL_QTYPE_Q8_0, x, q, NV), 0);
        cr_assert_eq(sl_quant_decode(SL_QTYPE_Q8_0, q, y, NV), 0);
        for (int b = 0; b < NV / 32; b++) {
            double amax = 0, emax = 0;
            for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(x[32 * b + i]));
            for (int i = 0; i < 32; i++)
                emax = fmax(emax, fabs((double)y[32 * b + i] - x[32 * b + i]));
            double d = amax / 127;
            double bound = 0.5 * d + 127 * fmax(d * 0x1p-11, 0x1p-25) + 0x1p-20 * amax;
            cr_expect(emax <= bound, "q8_0 %s block %d: err %.4g > %.4g", name, b, emax, bound);
            /* the stored d is the f16 of amax/127 */
            cr_expect_eq(get16(q + 34 * b), sl_f32_to_f16((float)amax / 127), "q8_0 d");
        }

        /* f16: half an ulp relative (2^-11), or 2^-25 absolute in the subnormal range */
        cr_assert_eq(sl_quant_encode(SL_QTYPE_F16, x, q, NV), 0);
        cr_assert_eq(sl_quant_decode(SL_QTYPE_F16, q, y, NV), 0);
        for (int i = 0; i < NV; i++)
            cr_expect(fabs((double)y[i] - x[i]) <= fmax(fabs(x[i]) * 0x1p-11, 0x1p-25),
                      "f16 %s value %d: %.9g -> %.9g", name, i, (double)x[i], (double)y[i]);
        /* bf16: half an ulp relative, 2^-8 */
        cr_assert_eq(sl_quant_encode(SL_QTYPE_BF16, x, q, NV), 0);
        cr_assert_eq(sl_quant_decode(SL_QTYPE_BF16, q, y, NV), 0);
        for (int i = 0; i < NV; i++)
            cr_expect(fabs((double)y[i] - x[i]) <= fabs(x[i]) * 0x1p-8,
                      "bf16 %s value %d: %.9g -> %.9g", name, i, (double)x[i], (double)y[i]);
        /* f32: exact */
        cr_assert_eq(sl_quant_encode(SL_QTYPE_F32, x, q, NV), 0);
        cr_assert_eq(sl_quant_decode(SL_QTYPE_F32, q, y, NV), 0);
        cr_expect_eq(memcmp(x, y, NV * sizeof *x), 0, "f32 %s", name);
    }
    free(x);
    free(y);
    free(q);
}

/* Inputs that lie exactly on a grid the format can store must come back (nearly)
 * exactly: this is what the scale searches are for. */
Test(encode, exact_grids)
{
    float x[2 * SL_QK_K], y[2 * SL_QK_K];
    uint8_t q[2 * SL_QK_K / 32 * 34]; /* the largest: Q8_0 */

    /* Q3_K: x = c/4 with c in -4..3 and a -4 in every sub-block: scale 1/4 everywhere,
     * stored as d = -1/128 (f16-exact) times -32. Exact. */
    for (int i = 0; i < 2 * SL_QK_K; i++) x[i] = (float)((i * 5 + i / 16) % 8 - 4) / 4;
    for (int k = 0; k < 32; k++) x[16 * k + 3] = -1.0f;
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q3_K, x, q, 2 * SL_QK_K), 0);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q3_K, q, y, 2 * SL_QK_K), 0);
    cr_expect_eq(get16(q + 108), 0xa000, "q3_K d = -1/128, got %04x", get16(q + 108));
    expect_same(y, x, 2 * SL_QK_K, "q3_K grid");

    /* Q6_K: x = c/64, c in -32..31, a -32 in every sub-block: d = -1/8192, scales -128 */
    for (int i = 0; i < 2 * SL_QK_K; i++) x[i] = (float)((i * 19 + i / 16) % 64 - 32) / 64;
    for (int k = 0; k < 32; k++) x[16 * k + 5] = -0.5f;
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q6_K, x, q, 2 * SL_QK_K), 0);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q6_K, q, y, 2 * SL_QK_K), 0);
    cr_expect_eq(get16(q + 208), 0x8800, "q6_K d = -1/8192, got %04x", get16(q + 208));
    expect_same(y, x, 2 * SL_QK_K, "q6_K grid");

    /* Q8_0: x = c/4 with c in -127..127 and 127 in every block: d = 1/4, exact */
    for (int i = 0; i < 2 * SL_QK_K; i++) x[i] = (float)((i * 37) % 255 - 127) / 4;
    for (int k = 0; k < 16; k++) x[32 * k + 7] = 127.0f / 4;
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q8_0, x, q, 2 * SL_QK_K), 0);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q8_0, q, y, 2 * SL_QK_K), 0);
    cr_expect_eq(get16(q), 0x3400);
    expect_same(y, x, 2 * SL_QK_K, "q8_0 grid");

    /* Q2_K: x = c/2 - 1/4 with every c in 0..3 in each sub-block: the min/max fit is
     * exact (scale 1/2, min 1/4); the 4-bit scales then carry d = f16(1/30) and
     * dmin = f16(1/60), so only their f16 rounding remains: (3*0.5 + 0.25)*2^-11, plus f32
     * rounding: 2*2^-11. */
    for (int i = 0; i < SL_QK_K; i++) x[i] = (float)((i * 3 + i / 16) % 4) / 2 - 0.25f;
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q2_K, x, q, SL_QK_K), 0);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q2_K, q, y, SL_QK_K), 0);
    for (int k = 0; k < 16; k++) cr_expect_eq(q[k], 0xff, "q2_K scales byte %d: %02x", k, q[k]);
    for (int i = 0; i < SL_QK_K; i++)
        cr_expect(fabsf(y[i] - x[i]) <= 2.0f * 0x1p-11f, "q2_K grid %d: %.9g -> %.9g", i,
                  (double)x[i], (double)y[i]);

    /* Q4_K: x = c/8 - 1/2 with every c in 0..15 in each sub-block: exact fit, 6-bit
     * scales 63, only f16 rounding of d and dmin left: (15/8 + 1/2)*2^-11, plus f32
     * rounding: 2.5*2^-11. */
    for (int i = 0; i < SL_QK_K; i++) x[i] = (float)((i * 7 + i / 32) % 16) / 8 - 0.5f;
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q4_K, x, q, SL_QK_K), 0);
    cr_assert_eq(sl_quant_decode(SL_QTYPE_Q4_K, q, y, SL_QK_K), 0);
    for (int i = 0; i < SL_QK_K; i++)
        cr_expect(fabsf(y[i] - x[i]) <= 2.5f * 0x1p-11f, "q4_K grid %d: %.9g -> %.9g", i,
                  (double)x[i], (double)y[i]);
}

Test(encode, q8_0_hand_block)
{
    /* x_j = j - 16: amax 16, d = 16/127 = 0.12598..: f16 0x3008 (2^-3 * 1.0078125);
     * codes roundf(x * 127/16): -16 -> -127, 1 -> 7.9375 -> 8, 3 -> 23.8125 -> 24,
     * -2 -> -15.875 -> -16, 5 -> 39.6875 -> 40 */
    float x[32];
    uint8_t q[34];
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 16);
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q8_0, x, q, 32), 0);
    cr_expect_eq(get16(q), 0x3008);
    cr_expect_eq((int8_t)q[2 + 0], -127);
    cr_expect_eq((int8_t)q[2 + 16], 0);
    cr_expect_eq((int8_t)q[2 + 17], 8);
    cr_expect_eq((int8_t)q[2 + 19], 24);
    cr_expect_eq((int8_t)q[2 + 14], -16);
    cr_expect_eq((int8_t)q[2 + 21], 40);
    cr_expect_eq((int8_t)q[2 + 31], 119); /* 15 * 7.9375 = 119.06 */
}

/* The reference Q8_0 multiplies by id = 1/d (f32) where q8_1 divides by d: find inputs
 * where the two round apart and check that the multiplication wins. d = 1/127. */
Test(encode, q8_0_multiplies_by_inverse)
{
    float x[32] = {1.0f};
    const float d = 1.0f / 127;
    const float id = 1.0f / d;
    int found = 1;
    for (int k = -120; k <= 120 && found < 32; k++) {
        float t = ((float)k + 0.5f) * d;
        for (int u = -4; u <= 4 && found < 32; u++) {
            float v = t;
            for (int s = 0; s < (u < 0 ? -u : u); s++) v = nextafterf(v, u < 0 ? -2.0f : 2.0f);
            if (roundf(v / d) != roundf(v * id)) x[found++] = v;
        }
    }
    cr_assert_gt(found, 4, "no input found where x/d and x*(1/d) round apart");
    uint8_t q[34];
    cr_assert_eq(sl_quant_encode(SL_QTYPE_Q8_0, x, q, 32), 0);
    for (int j = 1; j < found; j++)
        cr_expect_eq((int8_t)q[2 + j], (int8_t)roundf(x[j] * id), "x %.9g", (double)x[j]);
}

Test(encode, rejects)
{
    float x[512] = {0};
    uint8_t q[2048];
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q2_K, x, q, 255), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q6_K, x, q, 384), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q8_0, x, q, 16), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q5_K, x, q, 256), SL_EINVAL); /* not encodable */
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q4_0, x, q, 32), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_I8, x, q, 32), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(7777, x, q, 32), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q4_K, NULL, q, 256), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q4_K, x, NULL, 256), SL_EINVAL);
    cr_expect_eq(sl_quant_encode(SL_QTYPE_Q4_K, x, q, 0), 0);
}

/* ------------------------------------------------------------------ q8_1 */

Test(q8_1, half_away_rounding)
{
    /* amax 127 makes d exactly 1, so x/d = x: the .5 cases are exact ties */
    float x[32] = {127.0f, 2.5f,   -2.5f,   0.5f,  -0.5f,        1.5f,        -1.5f, 3.5f,
                   -3.5f,  126.5f, -126.5f, 0.49f, -0.49999997f, 0.50000006f, 64.5f, -64.5f};
    int8_t want[32] = {127, 3, -3, 1, -1, 2, -2, 4, -4, 127, -127, 0, 0, 1, 65, -65};
    sl_block_q8_1 b;
    cr_assert_eq(sl_quant_q8_1(x, &b, 32), 0);
    cr_expect_eq(b.d, 1.0f);
    for (int j = 0; j < 32; j++)
        cr_expect_eq(b.qs[j], want[j], "x %.9g -> %d, want %d", (double)x[j], b.qs[j], want[j]);
}

Test(q8_1, divides_by_d)
{
    /* The GPU computes x/d, not x*(1/d); find inputs where the two round apart and
     * check that the division wins. d = 1/127 (amax 1). */
    float x[32] = {1.0f};
    const float d = 1.0f / 127;
    const float id = 1.0f / d;
    int found = 1;
    for (int k = -120; k <= 120 && found < 32; k++) {
        float t = ((float)k + 0.5f) * d;
        for (int u = -4; u <= 4 && found < 32; u++) {
            float v = t;
            for (int s = 0; s < (u < 0 ? -u : u); s++) v = nextafterf(v, u < 0 ? -2.0f : 2.0f);
            if (roundf(v / d) != roundf(v * id)) x[found++] = v;
        }
    }
    cr_assert_gt(found, 4, "no input found where x/d and x*(1/d) round apart");
    sl_block_q8_1 b;
    cr_assert_eq(sl_quant_q8_1(x, &b, 32), 0);
    cr_expect_eq(fbits(b.d), fbits(d));
    for (int j = 1; j < found; j++)
        cr_expect_eq(b.qs[j], (int8_t)roundf(x[j] / d), "x %.9g", (double)x[j]);
}

Test(q8_1, zero_block_and_sum)
{
    float x[96] = {0};
    x[32] = -0.0f;
    x[33] = -0.0f;
    /* third block: s is the f32 sum in index order: (2^24 + 1) rounds to 2^24, minus
     * 2^24 is 0, plus 1 is 1. Reverse order would give 2; the codes give 0. */
    x[64] = 16777216.0f;
    x[65] = 1.0f;
    x[66] = -16777216.0f;
    x[67] = 1.0f;
    sl_block_q8_1 b[3];
    memset(b, 0x55, sizeof b);
    cr_assert_eq(sl_quant_q8_1(x, b, 96), 0);
    for (int k = 0; k < 2; k++) {
        cr_expect_eq(b[k].d, 0.0f);
        cr_expect_eq(b[k].s, 0.0f);
        for (int j = 0; j < 32; j++) cr_expect_eq(b[k].qs[j], 0);
    }
    cr_expect_eq(b[2].s, 1.0f, "s = %.9g", (double)b[2].s);
    cr_expect_eq(b[2].d, 16777216.0f / 127);
    cr_expect_eq(b[2].qs[0], 127);
    cr_expect_eq(b[2].qs[1], 0);
    cr_expect_eq(b[2].qs[2], -127);
}

Test(q8_1, random_blocks)
{
    enum { N = 64 * 32 };
    static float x[N];
    static sl_block_q8_1 b[N / 32];
    rng r = {12345};
    for (int i = 0; i < N; i++) x[i] = rng_gauss(&r) * (float)(1 + i / 32);
    cr_assert_eq(sl_quant_q8_1(x, b, N), 0);
    for (int k = 0; k < N / 32; k++) {
        float amax = 0, s = 0;
        for (int j = 0; j < 32; j++) {
            amax = fmaxf(amax, fabsf(x[32 * k + j]));
            s += x[32 * k + j];
        }
        cr_expect_eq(fbits(b[k].d), fbits(amax / 127), "block %d d", k);
        cr_expect_eq(fbits(b[k].s), fbits(s), "block %d s", k);
        int has127 = 0;
        for (int j = 0; j < 32; j++) {
            double e = fabs((double)b[k].qs[j] * b[k].d - x[32 * k + j]);
            cr_expect(e <= 0.5 * b[k].d + 1e-4 * b[k].d, "block %d value %d err %.3g", k, j, e);
            has127 |= b[k].qs[j] == 127 || b[k].qs[j] == -127;
        }
        cr_expect(has127, "block %d: amax must take code +-127", k);
    }
}

Test(q8_1, rejects)
{
    float x[64] = {0};
    sl_block_q8_1 b[2];
    cr_expect_eq(sl_quant_q8_1(x, b, 31), SL_EINVAL);
    cr_expect_eq(sl_quant_q8_1(x, b, 33), SL_EINVAL);
    cr_expect_eq(sl_quant_q8_1(NULL, b, 32), SL_EINVAL);
    cr_expect_eq(sl_quant_q8_1(x, NULL, 32), SL_EINVAL);
    cr_expect_eq(sl_quant_q8_1(x, b, 0), 0);
}

/* ------------------------------------------------------------------ regression */

static uint64_t fnv1a(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* The exact bytes each quantizer writes for a fixed input (uniform values at several
 * scales with cubed heavy tails; plain f32 arithmetic only, so the input is the same
 * everywhere). Quantizers are meant to repeat the reference bit for bit; a change of
 * these digests changes every synthetic checkpoint and must be deliberate. */
Test(encode, digests)
{
    static const struct {
        uint32_t type;
        uint64_t digest;
    } want[] = {
        {SL_QTYPE_Q8_0, 0x51f2587bb222d329ull}, {SL_QTYPE_Q2_K, 0x1b7fccaf392db7e3ull},
        {SL_QTYPE_Q3_K, 0x858a796ff8f3ec04ull}, {SL_QTYPE_Q4_K, 0xbb9d5f2b31b324e9ull},
        {SL_QTYPE_Q6_K, 0x19691988de1c943full},
    };
    enum { N = 64 * SL_QK_K };
    static float x[N];
    static uint8_t q[N / 32 * 34]; /* the largest: Q8_0 */
    rng r = {0x5eed};
    for (int i = 0; i < N; i++) {
        float u = rng_uniform(&r);
        x[i] = i % 5 == 0 ? 4 * u * u * u : 0.05f * (float)(1 + (i / SL_QK_K) % 4) * u;
    }
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        memset(q, 0, sizeof q);
        cr_assert_eq(sl_quant_encode(want[k].type, x, q, N), 0);
        uint64_t h = fnv1a(q, sl_qtype_row_bytes(want[k].type, N));
        cr_expect_eq(h, want[k].digest, "%s digest 0x%016llx", sl_qtype_get(want[k].type)->name,
                     (unsigned long long)h);
    }
}
