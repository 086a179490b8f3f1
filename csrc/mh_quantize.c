/*
 * The int8 and int4 storage formats of the KV cache (mh_formats.h), written
 * once per appended row: plain float32 arithmetic in the order the Python
 * reference (tests/test_cache_formats.py) uses, so the stored bits are the
 * same on every path.  Compiled without ISA flags.
 */
#include <float.h>
#include <math.h>
#include "mh_kernels.h"

/* x rounded to an integer (ties to even), clamped to [lo, hi] (integers); NaN gives
   0.  Clamped first (rounding leaves the integer bounds where they are), then
   rounded by adding and taking away 1.5 * 2^23, which float32 arithmetic in its
   default rounding does exactly as nearbyintf for magnitudes below 2^22, without
   a call (the keys and values of a 2048-token prompt, 12 heads of 64, were
   quantised in 0.75x the time for int8 and 0.81x for int4).  Where float
   expressions are evaluated wider than float (x87), nearbyintf. */
static inline int mh_round_clamp(float x, float lo, float hi)
{
    if (x != x) return 0;
    const float c = x < lo ? lo : (x > hi ? hi : x);
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
    return (int)((c + 12582912.0f) - 12582912.0f);
#else
    return (int)nearbyintf(c);
#endif
}

void mh_quantize_i8(const float *x, int64_t rows, int64_t n, int8_t *q, float *scale)
{
    for (int64_t r = 0; r < rows; ++r, x += n, q += n) {
        float m = 0.0f;
        int nan = 0;
        for (int64_t c = 0; c < n; ++c) {
            const float a = fabsf(x[c]);
            if (a != a) nan = 1;
            else if (a > m) m = a;
        }
        float s = nan ? NAN : m / 127.0f;
        /* (a scale of a largest value near FLT_MAX, rounded up, would widen 127 to inf:
           the float below it widens the codes to finite values within half a step) */
        if (isinf(s * 127.0f)) s = nextafterf(s, 0.0f);
        const float safe = s > 0.0f ? s : 1.0f;
        for (int64_t c = 0; c < n; ++c) q[c] = (int8_t)mh_round_clamp(x[c] / safe, -127.0f, 127.0f);
        scale[r] = isfinite(s) ? s : NAN;
    }
}

/* The float16 bits of |x| (not NaN) rounded toward zero, or with `away` away from
   it (past 65504: 65504 toward zero, inf away). */
static inline uint16_t mh_half_magnitude(float x, int away)
{
    union { float f; uint32_t u; } v;
    v.f = x;
    const uint32_t a = v.u & 0x7fffffffu;
    uint32_t h;
    int inexact;
    if (a >= 0x47800000u) { /* 65536 or more */
        h = 0x7bffu;
        inexact = 1;
    } else if (a >= 0x38800000u) { /* 2^-14 or more: the exponent rebiased, truncated */
        h = (a - 0x38000000u) >> 13;
        inexact = (a & 0x1fffu) != 0;
    } else { /* a subnormal float16: a multiple of 2^-24 (exactly scaled) */
        const float m = fabsf(x) * 16777216.0f;
        h = (uint32_t)m;
        inexact = (float)h != m;
    }
    return (uint16_t)(h + (uint32_t)(away && inexact));
}

/* The float16 nearest x (not NaN) from below (x itself when float16 holds it; -inf
   below -65504) and from above (+inf above 65504): rounded in one conversion
   (rounding to nearest and stepping back where that went past x took int4's
   quantiser 1.3x the time). */
static inline uint16_t mh_half_down(float x)
{
    return x < 0 ? (uint16_t)(0x8000u | mh_half_magnitude(x, 1)) : mh_half_magnitude(x, 0);
}

static inline uint16_t mh_half_up(float x)
{
    return x < 0 ? (uint16_t)(0x8000u | mh_half_magnitude(x, 0)) : mh_half_magnitude(x, 1);
}

/* A group's (step, minimum) as stored, float16 bits (and *step, *lo as floats):
   the minimum rounded down and the step (max - that minimum) / 15 rounded up, so
   that the codes reach every value of the group, and the codes are worked out from
   the pair as stored (codes from the unrounded pair lost rows whose step rounded
   to 0 or a subnormal, and groups far from 0 whose minimum's rounding outweighed
   their range).  A group holding NaN or inf: NaN, NaN.  -0 taken as +0 (one pair
   for any order of the group's zeros).  Returns whether a group of finite values
   has a pair beyond float16's range (then inf in it). */
static inline int mh_i4_pair(const float *x, uint16_t *step16, uint16_t *lo16, float *step, float *lo)
{
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    for (int c = 0; c < MH_I4_GROUP; ++c) {
        if (x[c] != x[c]) nan = 1;
        mn = x[c] < mn ? x[c] : mn;
        mx = x[c] > mx ? x[c] : mx;
    }
    if (nan || !isfinite(mn) || !isfinite(mx)) {
        *step16 = *lo16 = mh_float_to_half(NAN);
        *step = *lo = NAN;
        return 0;
    }
    *lo16 = mh_half_down(mn + 0.0f);
    *lo = mh_half_to_float(*lo16);
    *step16 = mh_half_up((mx + 0.0f - *lo) / 15.0f);
    *step = mh_half_to_float(*step16);
    return !isfinite(*lo) || !isfinite(*step);
}

void mh_quantize_i4(const float *x, int64_t rows, int64_t n, uint8_t *q, uint16_t *pairs)
{
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < n / MH_I4_GROUP; ++g, x += MH_I4_GROUP, q += MH_I4_GROUP / 2) {
            uint16_t step16, lo16;
            float step, lo;
            mh_i4_pair(x, &step16, &lo16, &step, &lo);
            const float safe = step > 0.0f ? step : 1.0f;
            for (int c = 0; c < MH_I4_GROUP; c += 2)
                q[c / 2] = (uint8_t)(mh_round_clamp((x[c] - lo) / safe, 0.0f, 15.0f) |
                                     mh_round_clamp((x[c + 1] - lo) / safe, 0.0f, 15.0f) << 4);
            *pairs++ = step16;
            *pairs++ = lo16;
        }
    }
}

int64_t mh_i4_overflows(const float *x, int64_t rows, int64_t n)
{
    int64_t over = 0;
    uint16_t step16, lo16;
    float step, lo;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < n / MH_I4_GROUP; ++g, x += MH_I4_GROUP)
            over += mh_i4_pair(x, &step16, &lo16, &step, &lo);
    return over;
}
