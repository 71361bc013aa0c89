/* score.h - the router's score, sqrt(softplus(logit)), from correctly rounded double
 * operations only.
 *
 * The selection runs on the CPU (router.c) and on the GPU (k_route_select in
 * compute/moe_kern.cuh); both must pick the same experts with the same weights, bit
 * for bit. libm's expf/log1pf and CUDA's differ in the last ulp, so neither is used:
 * this file computes e^w and log1p(t) with its own polynomials and table in double,
 * every step one IEEE operation (on the device __dmul_rn, __dadd_rn, __fma_rn,
 * __dsqrt_rn, so that nvcc cannot contract them; on the host ISO C without FP
 * contraction, and every multiply-add written as fma). The same source therefore
 * gives the same bits on both sides.
 *
 * On the device the score is on the layer's critical path (one thread an expert, each
 * a dependent chain of double operations), so the chain is short: softplus(v) as
 * max(v, 0) + log1p(e^-|v|), so that log1p sees t in [0, 1] and needs no division
 * (a table of 64 entries, SL_SCORE_TAB_INIT, instead), and both polynomials evaluated as
 * Estrin's tree rather than Horner's chain (about 35 dependent operations, against
 * about 75 with the two divisions and Horner's chains of sessions before 23).
 *
 * Accuracy: e^w and log1p(t) within a few double ulps, so the f32 score is the
 * correctly rounded sqrt(softplus(logit)) or one f32 ulp from it (tests/test_router.c
 * checks one ulp against libm's double functions over the whole f32 logit range).
 */
#ifndef SL_SCORE_H
#define SL_SCORE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define SL_SCORE_FN static __host__ __device__ inline
#else
#define SL_SCORE_FN static inline
#endif

SL_SCORE_FN double sl_score_mul(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

SL_SCORE_FN double sl_score_add(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

SL_SCORE_FN double sl_score_fma(double a, double b, double c)
{
#ifdef __CUDA_ARCH__
    return __fma_rn(a, b, c);
#else
    return fma(a, b, c);
#endif
}

SL_SCORE_FN double sl_score_sqrt(double a)
{
#ifdef __CUDA_ARCH__
    return __dsqrt_rn(a);
#else
    return sqrt(a);  /* IEEE: correctly rounded */
#endif
}

SL_SCORE_FN float sl_score_to_f32(double a)
{
#ifdef __CUDA_ARCH__
    return __double2float_rn(a);
#else
    return (float)a; /* round to nearest even */
#endif
}

/* The double with exponent field e (1..2046) and the given 52 fraction bits. */
SL_SCORE_FN double sl_score_make(uint64_t e, uint64_t frac)
{
    const uint64_t u = e << 52 | frac;
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

#define SL_SCORE_LN2_HI 6.93147180369123816490e-01 /* ln 2, upper 32 bits */
#define SL_SCORE_LN2_LO 1.90821492927058770002e-10 /* ln 2 - SL_SCORE_LN2_HI */

/* The table of sl_score_log1p: for t in [i/64, (i + 1)/64], c_i = 1 / (1 + (i + 1/2)/64)
 * rounded to 12 significant bits (c_0 = 1) and L_i = -ln c_i rounded to double; then
 * |c_i (1 + t) - 1| <= 2^-7 (2^-6 for i = 0). tests/test_router.c checks both. */
/* clang-format off */
#define SL_SCORE_TAB_INIT { \
    {1.0000000000000000, 0.0}, \
    {9.7705078125000000e-1, 0.023216651575664993}, \
    {9.6240234375000000e-1, 0.0383226790066782}, \
    {9.4824218750000000e-1, 0.053145337308128184}, \
    {9.3432617187500000e-1, 0.06792968129364145}, \
    {9.2089843750000000e-1, 0.0824055229659956}, \
    {9.0771484375000000e-1, 0.09682499843795439}, \
    {8.9501953125000000e-1, 0.11090973831969339}, \
    {8.8281250000000000e-1, 0.1246424452072766}, \
    {8.7084960937500000e-1, 0.1382859813604522}, \
    {8.5913085937500000e-1, 0.15183402939775856}, \
    {8.4765625000000000e-1, 0.16528009093910292}, \
    {8.3666992187500000e-1, 0.17832564484473487}, \
    {8.2592773437500000e-1, 0.19124799793863523}, \
    {8.1518554687500000e-1, 0.2043395267756892}, \
    {8.0493164062500000e-1, 0.21699792364761267}, \
    {7.9492187500000000e-1, 0.2295114395969128}, \
    {7.8515625000000000e-1, 0.24187253642048673}, \
    {7.7587890625000000e-1, 0.25375881962268243}, \
    {7.6635742187500000e-1, 0.26610660987739015}, \
    {7.5732421875000000e-1, 0.2779638229828596}, \
    {7.4853515625000000e-1, 0.2896371072875843}, \
    {7.3999023437500000e-1, 0.3011182896615406}, \
    {7.3144531250000000e-1, 0.31273282208223363}, \
    {7.2314453125000000e-1, 0.3241461718915996}, \
    {7.1508789062500000e-1, 0.3353498198916102}, \
    {7.0727539062500000e-1, 0.34633516894999333}, \
    {6.9946289062500000e-1, 0.35744253757050376}, \
    {6.9189453125000000e-1, 0.36832174646871796}, \
    {6.8457031250000000e-1, 0.378963918564863}, \
    {6.7724609375000000e-1, 0.3897205658445668}, \
    {6.7016601562500000e-1, 0.40022981277571273}, \
    {6.6333007812500000e-1, 0.410482557292996}, \
    {6.5649414062500000e-1, 0.420841510450479}, \
    {6.4965820312500000e-1, 0.43130889574165454}, \
    {6.4331054687500000e-1, 0.441127705743881}, \
    {6.3671875000000000e-1, 0.4514272436728001}, \
    {6.3061523437500000e-1, 0.46105937362350324}, \
    {6.2451171875000000e-1, 0.47078518458055574}, \
    {6.1840820312500000e-1, 0.4806065167176685}, \
    {6.1254882812500000e-1, 0.4901266203529214}, \
    {6.0668945312500000e-1, 0.49973822818861463}, \
    {6.0083007812500000e-1, 0.5094431163282879}, \
    {5.9545898437500000e-1, 0.5184227685034234}, \
    {5.8984375000000000e-1, 0.5278976076646381}, \
    {5.8447265625000000e-1, 0.5370452806014252}, \
    {5.7910156250000000e-1, 0.5462774066017276}, \
    {5.7397460937500000e-1, 0.5551701181792742}, \
    {5.6884765625000000e-1, 0.5641426201595975}, \
    {5.6396484375000000e-1, 0.5727633632035045}, \
    {5.5883789062500000e-1, 0.581895846766777}, \
    {5.5419921875000000e-1, 0.5902310562438954}, \
    {5.4931640625000000e-1, 0.5990806715208778}, \
    {5.4467773437500000e-1, 0.6075609722868112}, \
    {5.4003906250000000e-1, 0.6161138040771182}, \
    {5.3564453125000000e-1, 0.6242845258841682}, \
    {5.3100585937500000e-1, 0.6329822231965593}, \
    {5.2685546875000000e-1, 0.6408290209012637}, \
    {5.2246093750000000e-1, 0.6492050587034466}, \
    {5.1831054687500000e-1, 0.6571807050160876}, \
    {5.1416015625000000e-1, 0.665220474025423}, \
    {5.1000976562500000e-1, 0.673325405162778}, \
    {5.0585937500000000e-1, 0.68149656333997}, \
    {5.0195312500000000e-1, 0.6892485401442879}, \
}
/* clang-format on */
#define SL_SCORE_TAB_N 64

/* e^w for w <= 0: k = rint(w / ln 2), r = w - k ln 2 in two fma steps (|r| <= 0.35),
 * Taylor to degree 13 (truncation < 1e-17 relative) as Estrin's tree (depth 4 after
 * r), then times 2^k in two exact steps of normal powers of two (the second rounds
 * once when the result is subnormal). Below -745.2 the result is +0. */
SL_SCORE_FN double sl_score_exp(double w)
{
    if (w < -745.2) return 0.0;
    const double k = rint(sl_score_mul(w, 1.4426950408889634));
    double r = sl_score_fma(-k, SL_SCORE_LN2_HI, w);
    r = sl_score_fma(-k, SL_SCORE_LN2_LO, r);
    const double r2 = sl_score_mul(r, r), r4 = sl_score_mul(r2, r2), r8 = sl_score_mul(r4, r4);
    /* a_j = 1/(2j)! + r/(2j + 1)! */
    const double a0 = sl_score_add(r, 1.0);
    const double a1 = sl_score_fma(1.6666666666666666e-01, r, 0.5);
    const double a2 = sl_score_fma(8.333333333333333e-03, r, 4.1666666666666664e-02);
    const double a3 = sl_score_fma(1.984126984126984e-04, r, 1.388888888888889e-03);
    const double a4 = sl_score_fma(2.7557319223985893e-06, r, 2.48015873015873e-05);
    const double a5 = sl_score_fma(2.505210838544172e-08, r, 2.755731922398589e-07);
    const double a6 = sl_score_fma(1.6059043836821613e-10, r, 2.08767569878681e-09);
    const double b0 = sl_score_fma(a1, r2, a0), b1 = sl_score_fma(a3, r2, a2);
    const double b2 = sl_score_fma(a5, r2, a4);
    const double d0 = sl_score_fma(b1, r4, b0), d1 = sl_score_fma(a6, r4, b2);
    double p = sl_score_fma(d1, r8, d0);
    const int ki = (int)k;               /* -1075 .. 0 */
    const int k1 = ki / 2, k2 = ki - k1; /* each in -538 .. 0: normal powers of two */
    p = sl_score_mul(p, sl_score_make((uint64_t)(k1 + 1023), 0));
    return sl_score_mul(p, sl_score_make((uint64_t)(k2 + 1023), 0));
}

/* log1p(t) for t in [0, 1], with tab = SL_SCORE_TAB_INIT's values (wherever the caller
 * keeps them): i = floor(64 t) (63 at t = 1), f = c_i (1 + t) - 1 in one fma (c_i - 1 is
 * exact, so f has a single rounding, whatever 1 + t would have lost), |f| <= 2^-6;
 * log1p(t) = L_i + log1p(f), log1p(f) = f + f^2 Q(f) with Q Taylor's -1/2 + f/3 - ...
 * - f^8/10 (truncation < 2^-60 relative) as Estrin's tree. */
SL_SCORE_FN double sl_score_log1p(double t, const double (*tab)[2])
{
    int i = (int)sl_score_mul(t, 64.0);
    if (i > SL_SCORE_TAB_N - 1) i = SL_SCORE_TAB_N - 1;
    const double c = tab[i][0], l = tab[i][1];
    const double f = sl_score_fma(c, t, sl_score_add(c, -1.0));
    const double f2 = sl_score_mul(f, f), f4 = sl_score_mul(f2, f2), f8 = sl_score_mul(f4, f4);
    /* a_j = (-1)^(j+1) (1/(2j + 2) - f/(2j + 3)) */
    const double a0 = sl_score_fma(3.3333333333333331e-01, f, -0.5);
    const double a1 = sl_score_fma(0.2, f, -0.25);
    const double a2 = sl_score_fma(1.4285714285714285e-01, f, -1.6666666666666666e-01);
    const double a3 = sl_score_fma(1.1111111111111110e-01, f, -0.125);
    const double b0 = sl_score_fma(a1, f2, a0), b1 = sl_score_fma(a3, f2, a2);
    double q = sl_score_fma(b1, f4, b0);
    q = sl_score_fma(-0.1, f8, q);
    return sl_score_fma(f2, q, sl_score_add(l, f));
}

/* score(logit) = sqrt(softplus(logit)), softplus(v) = v for v > 20 (PyTorch's
 * threshold), else max(v, 0) + log1p(e^-|v|); computed in double, rounded once to f32
 * at the end (for v > 20 that is exactly sqrtf(v)). NaN stays NaN, +inf gives +inf,
 * -inf 0. tab: SL_SCORE_TAB_INIT's values (the device keeps them in shared memory). */
SL_SCORE_FN float sl_score_tab(float logit, const double (*tab)[2])
{
    if (logit != logit) return logit;
    const double v = (double)logit;
    if (v > 20.0) return sl_score_to_f32(sl_score_sqrt(v));
    const double l = sl_score_log1p(sl_score_exp(v > 0.0 ? -v : v), tab);
    return sl_score_to_f32(sl_score_sqrt(v > 0.0 ? sl_score_add(v, l) : l));
}

#ifndef __CUDA_ARCH__
static const double sl_score_tab_host[SL_SCORE_TAB_N][2] = SL_SCORE_TAB_INIT;

/* The score on the host, from the table in static memory. */
static inline float sl_score(float logit)
{
    return sl_score_tab(logit, sl_score_tab_host);
}
#endif

#endif
