/*
 * AVX-512F instantiation of the attention kernels (float32 and float64).
 * This file is compiled with AVX-512 enabled; nothing in it runs unless the
 * dispatcher (mh_dispatch.c) has checked that the CPU and OS support it.
 */
#include "mh_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>

/* ---------------------------------------------------------------- float32 */
#define T float
#define V __m512
#define VW 16
#define NVQ 4
#define JR 6
#define NVO 4
#define IR 6
#define FN(x) x##_f32_avx512
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(x) _mm512_set1_ps(x)
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_EXP(x) mh_exp_f32_avx512(x)
#define V_HSUM(x) _mm512_reduce_add_ps(x)
#define V_LOAD_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_NEG_INF_TO_ZERO(x) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), (x), \
                         _mm512_setzero_ps())

/* exp(x) to about 2 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 minimax
   polynomial for e^r, scaled by 2^n with scalef.  Inputs are clamped at -110,
   where 2^n underflows to exactly 0, so exp(-inf) = 0; NaN passes through
   (max returns its second operand when one operand is NaN). */
static inline __m512 mh_exp_f32_avx512(__m512 x)
{
    __m512 xc = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3836845755577087e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.374815806746483e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166822507977486e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666419804096222e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.9999991059303284e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#include "mh_attention_impl.h"

/* ---------------------------------------------------------------- float64 */
#define T double
#define V __m512d
#define VW 8
#define NVQ 4
#define JR 6
#define NVO 4
#define IR 6
#define FN(x) x##_f64_avx512
#define V_ZERO() _mm512_setzero_pd()
#define V_SET1(x) _mm512_set1_pd(x)
#define V_LOAD(p) _mm512_loadu_pd(p)
#define V_STORE(p, v) _mm512_storeu_pd((p), (v))
#define V_ADD(a, b) _mm512_add_pd((a), (b))
#define V_SUB(a, b) _mm512_sub_pd((a), (b))
#define V_MUL(a, b) _mm512_mul_pd((a), (b))
#define V_MAX(a, b) _mm512_max_pd((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define V_EXP(x) mh_exp_f64_avx512(x)
#define V_HSUM(x) _mm512_reduce_add_pd(x)
#define V_NEG_INF_TO_ZERO(x) \
    _mm512_mask_blend_pd(_mm512_cmp_pd_mask((x), _mm512_set1_pd(-INFINITY), _CMP_EQ_OQ), (x), \
                         _mm512_setzero_pd())

/* exp(x) to about 1 ulp in double: degree-13 polynomial on |r| <= ln2/2. */
static inline __m512d mh_exp_f64_avx512(__m512d x)
{
    const __m512d lo = _mm512_set1_pd(-708.3964185322641);
    __m512d xc = _mm512_max_pd(lo, x);
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(xc, _mm512_set1_pd(1.4426950408889634)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), xc);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
    static const double c[14] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0,
                                 1.0 / 3628800.0,    1.0 / 362880.0,    1.0 / 40320.0,
                                 1.0 / 5040.0,       1.0 / 720.0,       1.0 / 120.0,
                                 1.0 / 24.0,         1.0 / 6.0,         0.5,
                                 1.0,                1.0};
    __m512d p = _mm512_set1_pd(c[0]);
    for (int i = 1; i < 14; ++i) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c[i]));
    __m512d y = _mm512_scalef_pd(p, n);
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_pd());
}

#include "mh_attention_impl.h"

const mh_kernel_table mh_table_avx512 = {
    "avx512", mh_fwd_item_f32_avx512, mh_fwd_item_f64_avx512, mh_split_item_f32_avx512, mh_split_item_f64_avx512,
    mh_merge_item_f32_avx512, mh_merge_item_f64_avx512, mh_exp_array_f32_avx512, mh_exp_array_f64_avx512};
int mh_avx512_compiled = 1;
#else
int mh_avx512_compiled = 0;
#endif
