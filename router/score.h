/* score.h - the router's score, sqrt(softplus(logit)), from correctly rounded double
 * operations only.
 *
 * The selection runs on the CPU (router.c) and on the GPU (k_route_select in
 * compute/moe_kern.cuh); both must pick the same experts with the same weights, bit
 * for bit. libm's expf/log1pf and CUDA's differ in the last ulp, so neither is used:
 * this file computes e^v and log1p(t) with its own polynomials in double, every step
 * one IEEE operation (on the device __dmul_rn, __dadd_rn, __ddiv_rn, __fma_rn,
 * __dsqrt_rn, so that nvcc cannot contract them; on the host ISO C without FP
 * contraction, and every multiply-add written as fma). The same source therefore
 * gives the same bits on both sides.
 *
 * Accuracy: e^v and log1p(t) within a few double ulps, so the f32 score is the
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

SL_SCORE_FN double sl_score_div(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __ddiv_rn(a, b);
#else
    return a / b;
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

SL_SCORE_FN uint64_t sl_score_bits(double d)
{
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}

#define SL_SCORE_LN2_HI 6.93147180369123816490e-01 /* ln 2, upper 32 bits */
#define SL_SCORE_LN2_LO 1.90821492927058770002e-10 /* ln 2 - SL_SCORE_LN2_HI */

/* e^v for v <= 21 (the only range softplus needs): k = rint(v / ln 2), r = v - k ln 2
 * in two fma steps (|r| <= 0.35), Taylor to degree 13 (truncation < 1e-17 relative),
 * then times 2^k in two exact steps of normal powers of two (the second rounds once
 * when the result is subnormal). Below -745.2 the result is +0; NaN stays NaN. */
SL_SCORE_FN double sl_score_exp(double v)
{
    if (v != v) return v;
    if (v < -745.2) return 0.0;
    const double k = rint(sl_score_mul(v, 1.4426950408889634));
    double r = sl_score_fma(-k, SL_SCORE_LN2_HI, v);
    r = sl_score_fma(-k, SL_SCORE_LN2_LO, r);
    double p = 1.6059043836821613e-10;             /* 1/13! */
    p = sl_score_fma(p, r, 2.08767569878681e-09);  /* 1/12! */
    p = sl_score_fma(p, r, 2.505210838544172e-08); /* 1/11! */
    p = sl_score_fma(p, r, 2.755731922398589e-07); /* 1/10! */
    p = sl_score_fma(p, r, 2.7557319223985893e-06);
    p = sl_score_fma(p, r, 2.48015873015873e-05);
    p = sl_score_fma(p, r, 1.984126984126984e-04);
    p = sl_score_fma(p, r, 1.388888888888889e-03);
    p = sl_score_fma(p, r, 8.333333333333333e-03);
    p = sl_score_fma(p, r, 4.1666666666666664e-02);
    p = sl_score_fma(p, r, 1.6666666666666666e-01);
    p = sl_score_fma(p, r, 0.5);
    p = sl_score_fma(p, r, 1.0);
    p = sl_score_fma(p, r, 1.0);
    const int ki = (int)k;               /* -1075 .. 31 */
    const int k1 = ki / 2, k2 = ki - k1; /* each in -538 .. 16: normal powers of two */
    p = sl_score_mul(p, sl_score_make((uint64_t)(k1 + 1023), 0));
    return sl_score_mul(p, sl_score_make((uint64_t)(k2 + 1023), 0));
}

/* log1p(t) for t >= 0 (finite): u = 1 + t rounded, u = m 2^e with m in [sqrt(1/2),
 * sqrt(2)), log m = 2 atanh(s), s = (m - 1)/(m + 1), |s| <= 0.1716, as the odd series
 * to s^29 (truncation < 1e-24); then log1p(t) = log(u) * t / (u - 1), which cancels
 * the rounding of u. t so small that u rounds to 1 gives t. */
SL_SCORE_FN double sl_score_log1p(double t)
{
    const double u = sl_score_add(1.0, t);
    if (u == 1.0) return t;
    const uint64_t b = sl_score_bits(u);
    double e = (double)((int)(b >> 52 & 0x7ff) - 1023);
    double m = sl_score_make(1023, b & 0xfffffffffffffull); /* [1, 2) */
    if (m > 1.4142135623730951) {
        m = sl_score_mul(m, 0.5);
        e = sl_score_add(e, 1.0);
    }
    const double s = sl_score_div(sl_score_add(m, -1.0), sl_score_add(m, 1.0));
    const double s2 = sl_score_mul(s, s);
    double p = 3.4482758620689655e-02;               /* 1/29 */
    p = sl_score_fma(p, s2, 3.7037037037037035e-02); /* 1/27 */
    p = sl_score_fma(p, s2, 4.0000000000000001e-02); /* 1/25 */
    p = sl_score_fma(p, s2, 4.3478260869565216e-02);
    p = sl_score_fma(p, s2, 4.7619047619047616e-02);
    p = sl_score_fma(p, s2, 5.2631578947368418e-02);
    p = sl_score_fma(p, s2, 5.8823529411764705e-02);
    p = sl_score_fma(p, s2, 6.6666666666666666e-02);
    p = sl_score_fma(p, s2, 7.6923076923076927e-02);
    p = sl_score_fma(p, s2, 9.0909090909090912e-02);
    p = sl_score_fma(p, s2, 1.1111111111111110e-01);
    p = sl_score_fma(p, s2, 1.4285714285714285e-01);
    p = sl_score_fma(p, s2, 2.0000000000000001e-01);
    p = sl_score_fma(p, s2, 3.3333333333333331e-01); /* 1/3 */
    p = sl_score_fma(p, s2, 1.0);
    const double log_m = sl_score_mul(sl_score_mul(2.0, s), p);
    const double log_u = sl_score_fma(e, SL_SCORE_LN2_HI, sl_score_fma(e, SL_SCORE_LN2_LO, log_m));
    return sl_score_mul(log_u, sl_score_div(t, sl_score_add(u, -1.0)));
}

/* score(logit) = sqrt(softplus(logit)), softplus(v) = v for v > 20 (PyTorch's
 * threshold), else log1p(e^v); computed in double, rounded once to f32 at the end
 * (for v > 20 that is exactly sqrtf(v)). NaN stays NaN, +inf gives +inf, -inf 0. */
SL_SCORE_FN float sl_score(float logit)
{
    if (logit != logit) return logit;
    const double v = (double)logit;
    const double sp = v > 20.0 ? v : sl_score_log1p(sl_score_exp(v));
    return sl_score_to_f32(sl_score_sqrt(sp));
}

#endif
