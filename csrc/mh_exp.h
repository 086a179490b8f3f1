/*
 * Constants of the kernels' vector exp, shared by every ISA file.
 *
 * Scheme: x = n*ln2 + r with n = round(x*log2(e)) and |r| <= ln2/2 (ln2 split
 * into a high part exact in a few bits and a low correction, so n*ln2_hi is
 * exact); e^r from a polynomial in Horner form; 2^n put into the exponent
 * field (or applied with scalef on AVX-512).  Inputs below the clamp give 0,
 * so exp(-inf) = 0; NaN stays NaN.
 *
 * Measured error over [-87, 88] (float32) and [-700, 700] (float64) against a
 * long-double reference, 2^20 evenly spaced points plus 2^18 softmax-like
 * negative ones (tests/test_block_boundaries.py checks <= 4 ulp on every path):
 *   float32, degree-6 minimax:  1.05 ulp with FMA (AVX2, AVX-512, the aarch64 baseline's NEON),
 *                               1.30 ulp with separate multiply and add (x86 baseline)
 *   float64, degree-13 Taylor:  0.87 ulp (AVX2, AVX-512, the aarch64 baseline's NEON; the
 *                               x86 baseline calls libm's exp instead, 0.51 ulp)
 * (aarch64 measured under qemu-user emulation against numpy's 113-bit long double; on
 * these points the NEON results equal the AVX2 ones bit for bit, in both types.)
 */
#ifndef MANYHEADS_EXP_H
#define MANYHEADS_EXP_H

/* ---- float32 ---- */
#define MH_EXPF_LOG2E 1.44269504088896341f
#define MH_EXPF_LN2_HI 0.693359375f         /* 355/512: n*ln2_hi is exact for |n| < 2^15 */
#define MH_EXPF_LN2_LO (-2.12194440e-4f)    /* ln2 - ln2_hi */
#define MH_EXPF_MIN_ARG (-87.33654f)        /* ln(FLT_MIN): below, the result is 0 */
#define MH_EXPF_MAX_ARG 88.7228f            /* ln(FLT_MAX): above, the result is inf */
#define MH_EXPF_SCALEF_MIN_ARG (-110.0f)    /* scalef paths: 2^n underflows to exactly 0 */
#define MH_EXPF_ROUND 12582912.0f           /* 1.5*2^23: adding it rounds to an integer */
/* minimax polynomial for e^r on |r| <= ln2/2, highest degree first */
#define MH_EXPF_P6 1.3836845755577087e-3f
#define MH_EXPF_P5 8.374815806746483e-3f
#define MH_EXPF_P4 4.166822507977486e-2f
#define MH_EXPF_P3 1.6666419804096222e-1f
#define MH_EXPF_P2 4.9999991059303284e-1f
#define MH_EXPF_P1 1.0f
#define MH_EXPF_P0 1.0f

/* ---- float64 ---- */
#define MH_EXP_LOG2E 1.4426950408889634
#define MH_EXP_LN2_HI 6.93147180369123816490e-01
#define MH_EXP_LN2_LO 1.90821492927058770002e-10
#define MH_EXP_MIN_ARG (-708.3964185322641) /* ln(DBL_MIN) */
#define MH_EXP_ROUND 6755399441055744.0     /* 1.5*2^52 */
#define MH_EXP_DEGREE 13
/* Taylor coefficients 1/k!, k = 13 down to 0 */
static const double mh_exp_f64_poly[MH_EXP_DEGREE + 1] = {
    1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
    1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,
    1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,        0.5,
    1.0,                1.0};

/* ---- 2^x, the softmax's exponential ----
   The kernels keep scores in log2 units (the query is pre-scaled by
   scale * log2(e)), so the softmax needs 2^x for x <= 0 (and NaN): x = n + f
   with n = round(x) and |f| <= 1/2 exact, 2^f = e^(f ln2) from the
   polynomials above with each coefficient times ln2^k, 2^n put into the
   exponent field (or applied with scalef).  No multiply by log2(e) and no
   two-part ln2 reduction.  float32: 0.93 ulp over [-126, 0] with FMA. */
#define MH_EXP2F_MIN_ARG (-127.0f)        /* n = -127: zero exponent field, 2^x = 0 exactly */
#define MH_EXP2F_SCALEF_MIN_ARG (-160.0f) /* scalef paths: 2^n underflows to exactly 0 */
#define MH_EXP2F_C6 1.53458124e-4f
#define MH_EXP2F_C5 1.33999309e-3f
#define MH_EXP2F_C4 9.61848907e-3f
#define MH_EXP2F_C3 5.55032864e-2f
#define MH_EXP2F_C2 2.40226462e-1f
#define MH_EXP2F_C1 6.93147182e-1f
#define MH_EXP2F_C0 1.0f
#define MH_EXP2_MIN_ARG (-1023.0)
#define MH_EXP2_SCALEF_MIN_ARG (-1100.0)
/* ln2^k / k!, k = 13 down to 0 */
static const double mh_exp2_f64_poly[MH_EXP_DEGREE + 1] = {
    1.3691488853904128e-12, 2.5678435993488206e-11, 4.4455382718708116e-10,
    7.0549116208011234e-09, 1.01780860092397e-07,   1.321548679014431e-06,
    1.5252733804059841e-05, 1.5403530393381609e-04, 1.3333558146428443e-03,
    9.6181291076284769e-03, 5.5504108664821583e-02, 2.4022650695910072e-01,
    6.9314718055994529e-01, 1.0};

#endif /* MANYHEADS_EXP_H */
