/*
 * Portable baseline instantiation of the attention kernels: plain C on
 * 16-byte vectors of 4 floats or 2 doubles (GCC/Clang vector extensions,
 * which become SSE2 on x86-64 and NEON on aarch64; lane structs elsewhere).
 * Compiled with no ISA flags; runs on every CPU the wheel supports.
 *
 * Multiply-adds are fused only where the target's baseline has an FMA
 * instruction, and then through an intrinsic: on aarch64 (NEON vfmaq).
 * Elsewhere a multiply-add stays a multiply then an add: x86-64's baseline
 * has no FMA, and under -std=c99 the compiler does not contract a*b+c.
 * aarch64's 32 vector registers also take larger register tiles.
 */
#include <math.h>
#include <stdint.h>
#include "mh_kernels.h"
#include "mh_exp.h"

#if (defined(__GNUC__) || defined(__clang__)) && !defined(MH_BASELINE_STRUCT)
/* GCC/Clang vector extensions: 4 lanes the compiler maps onto SSE2 or NEON. */
typedef float mh_v4f __attribute__((vector_size(16)));
typedef double mh_v2d __attribute__((vector_size(16)));
typedef int32_t mh_v4i __attribute__((vector_size(16)));
typedef int64_t mh_v2l __attribute__((vector_size(16)));
#define MH_LANE(v, l) ((v)[l])

static inline mh_v4f v4f_add(mh_v4f a, mh_v4f b) { return a + b; }
static inline mh_v4f v4f_sub(mh_v4f a, mh_v4f b) { return a - b; }
static inline mh_v4f v4f_mul(mh_v4f a, mh_v4f b) { return a * b; }
static inline mh_v4f v4f_div(mh_v4f a, mh_v4f b) { return a / b; }
static inline mh_v2d v2d_add(mh_v2d a, mh_v2d b) { return a + b; }
static inline mh_v2d v2d_sub(mh_v2d a, mh_v2d b) { return a - b; }
static inline mh_v2d v2d_mul(mh_v2d a, mh_v2d b) { return a * b; }
static inline mh_v2d v2d_div(mh_v2d a, mh_v2d b) { return a / b; }
/* max returns b where a > b is false, so a NaN in b is kept (as the x86 paths do) */
static inline mh_v4f v4f_max(mh_v4f a, mh_v4f b)
{
    mh_v4i m = a > b;
    return (mh_v4f)((m & (mh_v4i)a) | (~m & (mh_v4i)b));
}
static inline mh_v2d v2d_max(mh_v2d a, mh_v2d b)
{
    mh_v2l m = a > b;
    return (mh_v2d)((m & (mh_v2l)a) | (~m & (mh_v2l)b));
}
static inline mh_v4f v4f_set1(float s) { return (mh_v4f){s, s, s, s}; }
static inline mh_v2d v2d_set1(double s) { return (mh_v2d){s, s}; }
#if defined(__aarch64__)
/* aarch64: NEON with FMA and 32 vector registers, all of it baseline */
#include <arm_neon.h>
#define MH_BASELINE_NEON 1
/* (a memcpy of a vector to memory goes through general registers here: ld1/st1 do not) */
static inline mh_v4f v4f_load(const float *p) { return (mh_v4f)vld1q_f32(p); }
static inline mh_v2d v2d_load(const double *p) { return (mh_v2d)vld1q_f64(p); }
static inline void v4f_store(float *p, mh_v4f v) { vst1q_f32(p, (float32x4_t)v); }
static inline void v2d_store(double *p, mh_v2d v) { vst1q_f64(p, (float64x2_t)v); }
/* a*b + c in one rounding (fmla); the vector types convert bit for bit */
static inline mh_v4f v4f_fma(mh_v4f a, mh_v4f b, mh_v4f c)
{
    return (mh_v4f)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
}
static inline mh_v2d v2d_fma(mh_v2d a, mh_v2d b, mh_v2d c)
{
    return (mh_v2d)vfmaq_f64((float64x2_t)c, (float64x2_t)a, (float64x2_t)b);
}
/* (l0 + l1) + (l2 + l3), the lane sum's order elsewhere, in two pairwise adds
   (faddp) instead of three lane moves and three adds */
static inline float v4f_hsum(mh_v4f v)
{
    const float32x4_t p = vpaddq_f32((float32x4_t)v, (float32x4_t)v);
    return vpadds_f32(vget_low_f32(p));
}
static inline double v2d_hsum(mh_v2d v) { return vpaddd_f64((float64x2_t)v); }
/* out[0..4) = the lane sums of a, b, c, d in pairwise adds (the same order) */
static inline void v4f_hsum4(mh_v4f a, mh_v4f b, mh_v4f c, mh_v4f d, float *out)
{
    const float32x4_t ab = vpaddq_f32((float32x4_t)a, (float32x4_t)b);
    const float32x4_t cd = vpaddq_f32((float32x4_t)c, (float32x4_t)d);
    vst1q_f32(out, vpaddq_f32(ab, cd));
}
static inline void v2d_hsum4(mh_v2d a, mh_v2d b, mh_v2d c, mh_v2d d, double *out)
{
    vst1q_f64(out, vpaddq_f64((float64x2_t)a, (float64x2_t)b));
    vst1q_f64(out + 2, vpaddq_f64((float64x2_t)c, (float64x2_t)d));
}
/* Cache formats widened to 4 floats, for the float32 instantiation (see
   mh_formats.h and the V_LOAD_* macros below). */
/* 4 IEEE halves (uint16 bits), exactly (fcvtl: subnormals, inf and NaN too) */
static inline mh_v4f v4f_load_half(const uint16_t *p)
{
    return (mh_v4f)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
/* 4 four-bit values from 2 bytes, low nibble first: the 16 bits in every lane,
   shifted right by 0, 4, 8, 12 (ushl by negative counts) and masked.  The
   bytes go through a memcpy: an int4 row need not be 2-byte aligned. */
static inline mh_v4f v4f_load_u4(const uint8_t *p)
{
    uint16_t w;
    __builtin_memcpy(&w, p, sizeof w);
    const int32x4_t shifts = {0, -4, -8, -12};
    const uint32x4_t nib = vandq_u32(vshlq_u32(vdupq_n_u32(w), shifts), vdupq_n_u32(15));
    return (mh_v4f)vcvtq_f32_u32(nib);
}
#else
static inline mh_v4f v4f_load(const float *p) { mh_v4f r; __builtin_memcpy(&r, p, sizeof r); return r; }
static inline mh_v2d v2d_load(const double *p) { mh_v2d r; __builtin_memcpy(&r, p, sizeof r); return r; }
static inline void v4f_store(float *p, mh_v4f v) { __builtin_memcpy(p, &v, sizeof v); }
static inline void v2d_store(double *p, mh_v2d v) { __builtin_memcpy(p, &v, sizeof v); }
#endif
#else
/* Other compilers: small lane structs and lane loops. */
typedef struct { float x[4]; } mh_v4f;
typedef struct { double x[2]; } mh_v2d;
#define MH_LANE(v, l) ((v).x[l])

#define MH_LANEWISE(VT, N, name, expr)                              \
    static inline VT name(VT a, VT b)                               \
    {                                                               \
        VT r;                                                       \
        for (int l = 0; l < (N); ++l) r.x[l] = (expr);              \
        return r;                                                   \
    }
MH_LANEWISE(mh_v4f, 4, v4f_add, a.x[l] + b.x[l])
MH_LANEWISE(mh_v4f, 4, v4f_sub, a.x[l] - b.x[l])
MH_LANEWISE(mh_v4f, 4, v4f_mul, a.x[l] * b.x[l])
MH_LANEWISE(mh_v4f, 4, v4f_div, a.x[l] / b.x[l])
MH_LANEWISE(mh_v4f, 4, v4f_max, a.x[l] > b.x[l] ? a.x[l] : b.x[l])
MH_LANEWISE(mh_v2d, 2, v2d_add, a.x[l] + b.x[l])
MH_LANEWISE(mh_v2d, 2, v2d_sub, a.x[l] - b.x[l])
MH_LANEWISE(mh_v2d, 2, v2d_mul, a.x[l] * b.x[l])
MH_LANEWISE(mh_v2d, 2, v2d_div, a.x[l] / b.x[l])
MH_LANEWISE(mh_v2d, 2, v2d_max, a.x[l] > b.x[l] ? a.x[l] : b.x[l])
static inline mh_v4f v4f_set1(float s) { mh_v4f r = {{s, s, s, s}}; return r; }
static inline mh_v2d v2d_set1(double s) { mh_v2d r = {{s, s}}; return r; }
static inline mh_v4f v4f_load(const float *p) { mh_v4f r = {{p[0], p[1], p[2], p[3]}}; return r; }
static inline mh_v2d v2d_load(const double *p) { mh_v2d r = {{p[0], p[1]}}; return r; }
static inline void v4f_store(float *p, mh_v4f v) { for (int l = 0; l < 4; ++l) p[l] = v.x[l]; }
static inline void v2d_store(double *p, mh_v2d v) { for (int l = 0; l < 2; ++l) p[l] = v.x[l]; }
#endif

#define MH_UNARY(VT, ST, N, name, expr)                             \
    static inline VT name(VT a)                                     \
    {                                                               \
        VT r;                                                       \
        for (int l = 0; l < (N); ++l) {                             \
            ST t = MH_LANE(a, l);                                   \
            MH_LANE(r, l) = (expr);                                 \
        }                                                           \
        return r;                                                   \
    }
#ifdef MH_BASELINE_NEON
/* exp(x) on 4 lanes at once: mh_expf_poly's scheme and constants with fused
   multiply-adds and no branch (GCC 12 compiles the generic lane loop below to
   4 scalar exps with compares and branches).  fmax/fmin keep a NaN lane NaN;
   below the clamp the lane is cleared, so exp(-inf) = 0; at the top clamp
   n = 128 puts 255 into the exponent field, so the result is inf. */
static inline mh_v4f v4f_exp(mh_v4f a)
{
    const float32x4_t x = (float32x4_t)a, lo = vdupq_n_f32(MH_EXPF_MIN_ARG);
    const float32x4_t round = vdupq_n_f32(MH_EXPF_ROUND);
    const float32x4_t xc = vminq_f32(vmaxq_f32(x, lo), vdupq_n_f32(MH_EXPF_MAX_ARG));
    const float32x4_t t = vfmaq_f32(round, xc, vdupq_n_f32(MH_EXPF_LOG2E));
    const float32x4_t n = vsubq_f32(t, round);
    float32x4_t r = vfmsq_f32(xc, n, vdupq_n_f32(MH_EXPF_LN2_HI)); /* xc - n*ln2_hi */
    r = vfmsq_f32(r, n, vdupq_n_f32(MH_EXPF_LN2_LO));
    float32x4_t p = vdupq_n_f32(MH_EXPF_P6);
    p = vfmaq_f32(vdupq_n_f32(MH_EXPF_P5), p, r);
    p = vfmaq_f32(vdupq_n_f32(MH_EXPF_P4), p, r);
    p = vfmaq_f32(vdupq_n_f32(MH_EXPF_P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(MH_EXPF_P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(MH_EXPF_P1), p, r);
    p = vfmaq_f32(vdupq_n_f32(MH_EXPF_P0), p, r);
    /* n + 127 sits in the low bits of t (the rounding constant's mantissa) */
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vreinterpretq_s32_f32(t), vdupq_n_s32(127)), 23);
    const uint32x4_t y = vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(e)));
    return (mh_v4f)vreinterpretq_f32_u32(vbicq_u32(y, vcltq_f32(x, lo)));
}
#else
/* exp(x) in plain arithmetic (no libm call), scheme and constants in
   mh_exp.h, 2^n built in the exponent bits.  Below ln(FLT_MIN) gives 0, above
   ln(FLT_MAX) inf; NaN stays NaN.  (GCC 12 compiles the lane loop below one
   lane at a time, with compares and branches.) */
static inline float mh_expf_poly(float x)
{
    const float lo = MH_EXPF_MIN_ARG, hi = MH_EXPF_MAX_ARG;
    float xc = x < lo ? lo : (x > hi ? hi : x); /* NaN compares false: stays NaN */
    float t = xc * MH_EXPF_LOG2E + MH_EXPF_ROUND;
    float n = t - MH_EXPF_ROUND;
    float r = xc - n * MH_EXPF_LN2_HI;
    r = r - n * MH_EXPF_LN2_LO;
    float p = MH_EXPF_P6;
    p = p * r + MH_EXPF_P5;
    p = p * r + MH_EXPF_P4;
    p = p * r + MH_EXPF_P3;
    p = p * r + MH_EXPF_P2;
    p = p * r + MH_EXPF_P1;
    p = p * r + MH_EXPF_P0;
    union { float f; int32_t i; } u, e;
    u.f = t;
    e.i = (int32_t)(((uint32_t)u.i + 127u) << 23);
    float y = p * e.f;
    return x < lo ? 0.0f : (x > hi ? (float)INFINITY : y);
}

MH_UNARY(mh_v4f, float, 4, v4f_exp, mh_expf_poly(t))
#endif
MH_UNARY(mh_v4f, float, 4, v4f_ninf0, t == -INFINITY ? 0.0f : t)
#ifdef MH_BASELINE_NEON
/* exp(x) on 2 lanes in double: the same scheme with the degree-13 polynomial
   (instead of a libm call per lane).  Above ln(DBL_MAX) the clamp gives
   n = 1024, 2047 in the exponent field: inf.  (The AVX paths do not clamp
   above, hence no such constant in mh_exp.h.) */
#define MH_EXP_MAX_ARG_NEON 709.782712893384 /* ln(DBL_MAX) */
static inline mh_v2d v2d_exp(mh_v2d a)
{
    const float64x2_t x = (float64x2_t)a, lo = vdupq_n_f64(MH_EXP_MIN_ARG);
    const float64x2_t round = vdupq_n_f64(MH_EXP_ROUND);
    const float64x2_t xc = vminq_f64(vmaxq_f64(x, lo), vdupq_n_f64(MH_EXP_MAX_ARG_NEON));
    const float64x2_t t = vfmaq_f64(round, xc, vdupq_n_f64(MH_EXP_LOG2E));
    const float64x2_t n = vsubq_f64(t, round);
    float64x2_t r = vfmsq_f64(xc, n, vdupq_n_f64(MH_EXP_LN2_HI));
    r = vfmsq_f64(r, n, vdupq_n_f64(MH_EXP_LN2_LO));
    float64x2_t p = vdupq_n_f64(mh_exp_f64_poly[0]);
    for (int i = 1; i <= MH_EXP_DEGREE; ++i) p = vfmaq_f64(vdupq_n_f64(mh_exp_f64_poly[i]), p, r);
    const int64x2_t e = vshlq_n_s64(vaddq_s64(vreinterpretq_s64_f64(t), vdupq_n_s64(1023)), 52);
    const uint64x2_t y = vreinterpretq_u64_f64(vmulq_f64(p, vreinterpretq_f64_s64(e)));
    return (mh_v2d)vreinterpretq_f64_u64(vbicq_u64(y, vcltq_f64(x, lo)));
}
#else
MH_UNARY(mh_v2d, double, 2, v2d_exp, exp(t))
#endif
MH_UNARY(mh_v2d, double, 2, v2d_ninf0, t == -INFINITY ? 0.0 : t)

/* ---------------------------------------------------------------- float32 */
#define T float
#define V mh_v4f
#define VW 4
#ifdef MH_BASELINE_NEON
/* aarch64's 32 vector registers: 4x4 tiles, 16 accumulators beside 4 operand vectors
   and 4 keys (or probabilities) used by lane; 4x6 spills (GCC 12), 4x5 leaves single
   keys and rows over in a block of 64 */
#define NVQ 4
#define JR 4
#define NVO 4
#define IR 4
#else
/* SSE2's 16 registers: 8 accumulators */
#define NVQ 2
#define JR 4
#define NVO 2
#define IR 4
#endif
#define FN(x) x##_f32_baseline
#define V_ZERO() v4f_set1(0.0f)
#define V_SET1(x) v4f_set1(x)
#define V_LOAD(p) v4f_load(p)
#define V_STORE(p, v) v4f_store((p), (v))
#define V_ADD(a, b) v4f_add((a), (b))
#define V_SUB(a, b) v4f_sub((a), (b))
#define V_MUL(a, b) v4f_mul((a), (b))
#define V_DIV(a, b) v4f_div((a), (b))
#define V_MAX(a, b) v4f_max((a), (b))
#ifdef MH_BASELINE_NEON
#define V_FMA(a, b, c) v4f_fma((a), (b), (c))
#else
#define V_FMA(a, b, c) v4f_add(v4f_mul((a), (b)), (c)) /* two roundings, as the ISA has it */
#endif
#define V_EXP(x) v4f_exp(x)
#define V_NEG_INF_TO_ZERO(x) v4f_ninf0(x)
#ifdef MH_BASELINE_NEON
#define V_HSUM(v) v4f_hsum(v)
#define V_HSUM4(a, b, c, d, out) v4f_hsum4((a), (b), (c), (d), (out))
/* With V_LOAD_HALF the few-rows path reads float16 keys and values in place.
   No V_LOAD_BF16 or V_LOAD_I8: GCC vectorises their scalar loops 8 and 16
   values at a time (shll/shll2, sxtl/sxtl2), fewer instructions per value
   than a loop of 4-value loaders (measured with GCC 12: 1.3 and 1.7 per value
   against 2.0 and 3.0 in the decode readers). */
#define V_LOAD_HALF(p) v4f_load_half(p)
#define V_LOAD_U4(p) v4f_load_u4(p)
#else
#define V_HSUM(v) ((MH_LANE(v, 0) + MH_LANE(v, 1)) + (MH_LANE(v, 2) + MH_LANE(v, 3)))
#endif
/* what this instantiation can do (mh_instance.h): on aarch64, widen float16
   and 4-bit values in vector code and sum four vectors' lanes at once;
   elsewhere none of the optional pieces */
#ifdef MH_BASELINE_NEON
#define MH_HAS_HSUM4 1
#define MH_HAS_F16_LOAD 1
#define MH_HAS_U4_LOAD 1
#endif
#include "mh_instance.h"

/* ---------------------------------------------------------------- float64 */
#define T double
#define V mh_v2d
#define VW 2
#ifdef MH_BASELINE_NEON
#define NVQ 4
#define JR 4
#define NVO 4
#define IR 4
#else
#define NVQ 2
#define JR 4
#define NVO 2
#define IR 4
#endif
#define FN(x) x##_f64_baseline
#define V_ZERO() v2d_set1(0.0)
#define V_SET1(x) v2d_set1(x)
#define V_LOAD(p) v2d_load(p)
#define V_STORE(p, v) v2d_store((p), (v))
#define V_ADD(a, b) v2d_add((a), (b))
#define V_SUB(a, b) v2d_sub((a), (b))
#define V_MUL(a, b) v2d_mul((a), (b))
#define V_DIV(a, b) v2d_div((a), (b))
#define V_MAX(a, b) v2d_max((a), (b))
#ifdef MH_BASELINE_NEON
#define V_FMA(a, b, c) v2d_fma((a), (b), (c))
#else
#define V_FMA(a, b, c) v2d_add(v2d_mul((a), (b)), (c))
#endif
#define V_EXP(x) v2d_exp(x)
#define V_NEG_INF_TO_ZERO(x) v2d_ninf0(x)
#ifdef MH_BASELINE_NEON
#define V_HSUM(v) v2d_hsum(v)
#define V_HSUM4(a, b, c, d, out) v2d_hsum4((a), (b), (c), (d), (out))
#else
#define V_HSUM(v) (MH_LANE(v, 0) + MH_LANE(v, 1))
#endif
/* what this instantiation can do (mh_instance.h): on aarch64, sum four
   vectors' lanes at once */
#ifdef MH_BASELINE_NEON
#define MH_HAS_HSUM4 1
#endif
#include "mh_instance.h"

MH_KERNEL_TABLE(baseline)
