/*
 * AVX2+FMA instantiation of the attention kernels (float32 and float64).
 * Compiled with AVX2 and FMA enabled; reached only through the dispatcher
 * after it has checked the CPU and OS.
 */
#include "mh_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include "mh_exp.h"

static inline float mh_hsum_f32_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* 8 four-bit values from 4 bytes (low nibble first) as floats. */
static inline __m256 mh_load_u4_avx2(const uint8_t *p)
{
    int32_t word;
    memcpy(&word, p, 4);
    const __m128i b = _mm_cvtsi32_si128(word), low4 = _mm_set1_epi8(0x0f);
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b, low4),
                                          _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
}

/* A group of 32 four-bit values from 16 bytes in split order (mh_few_rows.h,
   FN(u4_row)): u[0] and u[1] the even channels 0-14 and 16-30 (the low
   nibbles), u[2] and u[3] the odd ones. */
static inline void mh_load_u4_group_avx2(const uint8_t *p, __m256 *u)
{
    /* bytes 0-7 and 8-15 widened to 32 bits as they load; a byte's low nibble is its
       even channel, its high nibble the odd one */
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    u[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4));
    u[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4));
    u[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    u[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

/* The 4 vectors of a group (channels 0-7, 8-15, 16-23, 24-31) to split order
   and back.  shuffle_ps takes the even (odd) lanes of two vectors within each
   128-bit half; the 64-bit permute puts the halves in channel order. */
static inline void mh_split_group_avx2(__m256 *u)
{
    const __m256 e0 = _mm256_shuffle_ps(u[0], u[1], 0x88), o0 = _mm256_shuffle_ps(u[0], u[1], 0xDD);
    const __m256 e1 = _mm256_shuffle_ps(u[2], u[3], 0x88), o1 = _mm256_shuffle_ps(u[2], u[3], 0xDD);
#define MH_HALVES_IN_ORDER(x) _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8))
    u[0] = MH_HALVES_IN_ORDER(e0);
    u[1] = MH_HALVES_IN_ORDER(e1);
    u[2] = MH_HALVES_IN_ORDER(o0);
    u[3] = MH_HALVES_IN_ORDER(o1);
#undef MH_HALVES_IN_ORDER
}
static inline void mh_unsplit_group_avx2(__m256 *u)
{
    /* unpacklo of (evens, odds): channels 0-3 in the low half, 8-11 in the high */
    const __m256 a = _mm256_unpacklo_ps(u[0], u[2]), b = _mm256_unpackhi_ps(u[0], u[2]);
    const __m256 c = _mm256_unpacklo_ps(u[1], u[3]), d = _mm256_unpackhi_ps(u[1], u[3]);
    u[0] = _mm256_permute2f128_ps(a, b, 0x20);
    u[1] = _mm256_permute2f128_ps(a, b, 0x31);
    u[2] = _mm256_permute2f128_ps(c, d, 0x20);
    u[3] = _mm256_permute2f128_ps(c, d, 0x31);
}

static inline double mh_hsum_f64_avx2(__m256d v)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}

/* out[0..4) = the lane sums of a, b, c, d: three horizontal adds leave
   [a, b, c, d] partial sums in each 128-bit lane, then the two lanes added. */
static inline void mh_hsum4_f32_avx2(__m256 a, __m256 b, __m256 c, __m256 d, float *out)
{
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

static inline void mh_hsum4_f64_avx2(__m256d a, __m256d b, __m256d c, __m256d d, double *out)
{
    const __m256d ab = _mm256_hadd_pd(a, b); /* [a0+a1, b0+b1, a2+a3, b2+b3] */
    const __m256d cd = _mm256_hadd_pd(c, d);
    _mm256_storeu_pd(out, _mm256_add_pd(_mm256_permute2f128_pd(ab, cd, 0x20),
                                        _mm256_permute2f128_pd(ab, cd, 0x31)));
}

/* r[0..8) transposed in place: afterwards r[c][i] holds what r[i][c] held. */
static inline void mh_transpose_f32_avx2(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    /* u_m: column m (low half) and column m + 4 (high half) of four rows */
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

static inline void mh_transpose_f64_avx2(__m256d r[4])
{
    const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
    const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
    r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
    r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
    r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
    r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
}

/* ---------------------------------------------------------------- float32 */
#define T float
#define V __m256
#define VW 8
/* Register tiles for 16 vector registers.  Score tile: NVQ x JR accumulators
   plus NVQ query vectors and one broadcast key, 2x6 = 12 + 2 + 1 = 15 (3x4
   fills all 16).  Output tile: NVO value vectors x IR rows, 2x6 the same way.
   Measured one thread, causal, D=64, T=1024 (single-thread GF/s relative to
   2x6/2x6): score 3x4 and 4x3 equal within 1%, 2x5 -4%, 2x4 -6%, 1x8 -8%,
   3x3 -7%; output 2x5 -1%, 2x4 -3%, 3x4 -4%, 3x3 -4%, 1x8 -9%, 4x2 -25% (the
   compiler then folds the value loads into the FMAs: fewer instructions,
   more loads).  At T=128 and T=4096 no other shape is more than 3% faster. */
#define NVQ 2
#define JR 6
#define NVO 2
#define IR 6
#define FN(x) x##_f32_avx2
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(x) _mm256_set1_ps(x)
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_DIV(a, b) _mm256_div_ps((a), (b))
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_EXP(x) mh_exp_f32_avx2(x)
#define V_HSUM(x) mh_hsum_f32_avx2(x)
#define V_HSUM4(a, b, c, d, out) mh_hsum4_f32_avx2((a), (b), (c), (d), (out))
#define V_TRANSPOSE(r) mh_transpose_f32_avx2(r)
#define V_LOAD_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define V_LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define V_LOAD_U4(p) mh_load_u4_avx2((const uint8_t *)(p))
#define VI8 mh_i8w_avx2
#define V_I8_WIDEN(p) mh_i8_widen_avx2(p)
#define V_I8_DOT(W, xp) mh_i8_dot_avx2(&(W), (xp))
#define V_LOAD_I8_PAIRS(p, e, o) mh_load_i8_pairs_avx2((p), &(e), &(o))
/* int4 groups in split order (mh_few_rows.h, FN(u4_row)) */
#define V_LOAD_U4_GROUP(p, u) mh_load_u4_group_avx2((const uint8_t *)(p), (u))
#define V_SPLIT_GROUP(u) mh_split_group_avx2(u)
#define V_UNSPLIT_GROUP(u) mh_unsplit_group_avx2(u)
#define V_STORE_BF16(p, x) _mm_storeu_si128((__m128i *)(p), mh_to_bf16_avx2(x))
#define V_STORE_HALF(p, x) \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))

/* A blocked int8 pass (mh_linear_index) for 8 columns: each of its four pairs of
   rows (16 bytes: 8 columns x 2 rows) widened to 16 bits and multiplied by its pair of
   16-bit integers, the two products of a column added (madd), the four pairs' sums
   added: exact (at most 8 * 127 * 32767 in magnitude), then converted to float. */
typedef struct { __m256i w[4]; } mh_i8w_avx2;
static inline mh_i8w_avx2 mh_i8_widen_avx2(const int8_t *p)
{
    mh_i8w_avx2 W;
    for (int j = 0; j < 4; ++j)
        W.w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 32 * j)));
    return W;
}
static inline __m256 mh_i8_dot_avx2(const mh_i8w_avx2 *W, const __m256 *xp)
{
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(W->w[j], _mm256_castps_si256(xp[j])));
    return _mm256_cvtepi32_ps(s);
}

/* The pair of rows of 8 blocked int8 columns at p (16 bytes, even row first in each
   column) as floats: the even row in *e, the odd one in *o. */
static inline void mh_load_i8_pairs_avx2(const int8_t *p, __m256 *e, __m256 *o)
{
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    *e = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 16));
    *o = _mm256_cvtepi32_ps(_mm256_srai_epi32(w, 16));
}

/* x rounded to bfloat16 bits (nearest even; NaN: the high half with the quiet
   bit set), as mh_float_to_bf16 does lane by lane. */
static inline __m128i mh_to_bf16_avx2(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                          _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    const __m256i r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(u, bias), 16),
                                         _mm256_or_si256(hi, _mm256_set1_epi32(0x40)),
                                         _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    /* 32-bit lanes to 16 bits (values < 2^16: no saturation), both halves together */
    const __m256i p = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}
#define S_HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define S4_HALF_TO_FLOAT(dst, src) \
    _mm_storeu_ps((dst), _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(src))))
#define V_NEG_INF_TO_ZERO(x) \
    _mm256_andnot_ps(_mm256_cmp_ps((x), _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), (x))
/* hidden entries (mh_common.h): blendv selects on the sign bit */
#define V_MARK_HIDDEN(p, s)                                \
    _mm256_blendv_ps((p), _mm256_set1_ps(-0.0f),           \
                     _mm256_cmp_ps((s), _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ))
#define VM __m256
#define V_VISIBLE(p) (p)
#define V_FMA_VISIBLE(a, b, c, m) _mm256_blendv_ps(_mm256_fmadd_ps((a), (b), (c)), (c), (m))
#define V_WHERE_SMALL(x, t, a, b)                                                             \
    _mm256_blendv_ps((b), (a),                                                                \
                     _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x)), (t), _CMP_LT_OQ))

/* exp(x) (scheme and constants in mh_exp.h); 2^n is built in the exponent
   field from the rounding constant (n + 127 lands in the low mantissa bits). */
static inline __m256 mh_exp_f32_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(MH_EXPF_MIN_ARG);
    const __m256 round = _mm256_set1_ps(MH_EXPF_ROUND);
    __m256 xc = _mm256_max_ps(lo, x);
    __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(MH_EXPF_LOG2E), round);
    __m256 n = _mm256_sub_ps(t, round);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(MH_EXPF_LN2_HI), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(MH_EXPF_LN2_LO), r);
    __m256 p = _mm256_set1_ps(MH_EXPF_P6);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(MH_EXPF_P5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(MH_EXPF_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(MH_EXPF_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(MH_EXPF_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(MH_EXPF_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(MH_EXPF_P0));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
}

/* 2^x for x <= 0 or NaN (mh_exp.h); below -127 it is 0 (-inf gives 0). */
static inline __m256 mh_exp2_f32_avx2(__m256 x)
{
    const __m256 round = _mm256_set1_ps(MH_EXPF_ROUND);
    const __m256 xc = _mm256_max_ps(_mm256_set1_ps(MH_EXP2F_MIN_ARG), x); /* NaN stays */
    const __m256 t = _mm256_add_ps(xc, round);
    const __m256 f = _mm256_sub_ps(xc, _mm256_sub_ps(t, round));
    __m256 p = _mm256_set1_ps(MH_EXP2F_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(MH_EXP2F_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(MH_EXP2F_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(MH_EXP2F_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(MH_EXP2F_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(MH_EXP2F_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(MH_EXP2F_C0));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define V_EXP2(x) mh_exp2_f32_avx2(x)

/* what this instantiation can do (mh_instance.h) */
#define MH_HAS_EXP2 1
#define MH_HAS_TRANSPOSE 1
#define MH_HAS_HSUM4 1
#define MH_HAS_SELECT 1
#define MH_HAS_F16_LOAD 1
#define MH_HAS_BF16_LOAD 1
#define MH_HAS_I8_LOAD 1
#define MH_HAS_I8_PAIRS 1
#define MH_HAS_U4_LOAD 1
#define MH_HAS_U4_SPLIT 1
#define MH_HAS_HALF_STORE 1
#define MH_HAS_HALF_SCALAR 1
#include "mh_instance.h"

/* ---------------------------------------------------------------- float64 */
#define T double
#define V __m256d
#define VW 4
/* the same tiles: measured best for float64 too (score 3x4, 4x3 equal;
   output 2x5 -2%, 3x4 -7%, 4x2 -25%) */
#define NVQ 2
#define JR 6
#define NVO 2
#define IR 6
#define FN(x) x##_f64_avx2
#define V_ZERO() _mm256_setzero_pd()
#define V_SET1(x) _mm256_set1_pd(x)
#define V_LOAD(p) _mm256_loadu_pd(p)
#define V_STORE(p, v) _mm256_storeu_pd((p), (v))
#define V_ADD(a, b) _mm256_add_pd((a), (b))
#define V_SUB(a, b) _mm256_sub_pd((a), (b))
#define V_MUL(a, b) _mm256_mul_pd((a), (b))
#define V_DIV(a, b) _mm256_div_pd((a), (b))
#define V_MAX(a, b) _mm256_max_pd((a), (b))
#define V_FMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define V_EXP(x) mh_exp_f64_avx2(x)
#define V_HSUM(x) mh_hsum_f64_avx2(x)
#define V_HSUM4(a, b, c, d, out) mh_hsum4_f64_avx2((a), (b), (c), (d), (out))
#define V_TRANSPOSE(r) mh_transpose_f64_avx2(r)
#define V_NEG_INF_TO_ZERO(x) \
    _mm256_andnot_pd(_mm256_cmp_pd((x), _mm256_set1_pd(-INFINITY), _CMP_EQ_OQ), (x))
#define V_MARK_HIDDEN(p, s)                                \
    _mm256_blendv_pd((p), _mm256_set1_pd(-0.0),            \
                     _mm256_cmp_pd((s), _mm256_set1_pd(-INFINITY), _CMP_EQ_OQ))
#define VM __m256d
#define V_VISIBLE(p) (p)
#define V_FMA_VISIBLE(a, b, c, m) _mm256_blendv_pd(_mm256_fmadd_pd((a), (b), (c)), (c), (m))
#define V_WHERE_SMALL(x, t, a, b)                                                             \
    _mm256_blendv_pd((b), (a),                                                                \
                     _mm256_cmp_pd(_mm256_andnot_pd(_mm256_set1_pd(-0.0), (x)), (t), _CMP_LT_OQ))

/* exp(x) in double (scheme and constants in mh_exp.h). */
static inline __m256d mh_exp_f64_avx2(__m256d x)
{
    const __m256d lo = _mm256_set1_pd(MH_EXP_MIN_ARG);
    const __m256d round = _mm256_set1_pd(MH_EXP_ROUND);
    __m256d xc = _mm256_max_pd(lo, x);
    __m256d t = _mm256_fmadd_pd(xc, _mm256_set1_pd(MH_EXP_LOG2E), round);
    __m256d n = _mm256_sub_pd(t, round);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(MH_EXP_LN2_HI), xc);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(MH_EXP_LN2_LO), r);
    __m256d p = _mm256_set1_pd(mh_exp_f64_poly[0]);
    for (int i = 1; i <= MH_EXP_DEGREE; ++i)
        p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(mh_exp_f64_poly[i]));
    __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(1023)), 52);
    __m256d y = _mm256_mul_pd(p, _mm256_castsi256_pd(e));
    return _mm256_andnot_pd(_mm256_cmp_pd(x, lo, _CMP_LT_OQ), y);
}

/* 2^x in double for x <= 0 or NaN (mh_exp.h); below -1023 it is 0. */
static inline __m256d mh_exp2_f64_avx2(__m256d x)
{
    const __m256d round = _mm256_set1_pd(MH_EXP_ROUND);
    const __m256d xc = _mm256_max_pd(_mm256_set1_pd(MH_EXP2_MIN_ARG), x);
    const __m256d t = _mm256_add_pd(xc, round);
    const __m256d f = _mm256_sub_pd(xc, _mm256_sub_pd(t, round));
    __m256d p = _mm256_set1_pd(mh_exp2_f64_poly[0]);
    for (int i = 1; i <= MH_EXP_DEGREE; ++i)
        p = _mm256_fmadd_pd(p, f, _mm256_set1_pd(mh_exp2_f64_poly[i]));
    const __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_castpd_si256(t), _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}
#define V_EXP2(x) mh_exp2_f64_avx2(x)

/* what this instantiation can do (mh_instance.h) */
#define MH_HAS_EXP2 1
#define MH_HAS_TRANSPOSE 1
#define MH_HAS_HSUM4 1
#define MH_HAS_SELECT 1
#include "mh_instance.h"

MH_KERNEL_TABLE(avx2)
#else
MH_EMPTY_TABLE(avx2)
#endif
