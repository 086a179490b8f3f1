/*
 * AVX-512F instantiation of the attention kernels (float32 and float64).
 * This file is compiled with AVX-512 enabled; nothing in it runs unless the
 * dispatcher (mh_dispatch.c) has checked that the CPU and OS support it.
 *
 * mh_avx512bf16.c compiles it a second time with MH_AVX512_DPBF16 defined
 * (and AVX512-BW and AVX512-BF16 enabled): the same float32 kernels under the
 * suffix _avx512bf16, plus the bfloat16 pair-product tile path
 * (MH_HAS_BF16_DOT, the VP vocabulary below); its float64 entries are this
 * path's.
 */
#include "mh_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include "mh_exp.h"

#ifdef MH_AVX512_DPBF16
#define MH_SFX(x) x##_avx512bf16
#else
#define MH_SFX(x) x##_avx512
#endif

/* out[0..4) = the lane sums of a, b, c, d: adjacent lanes of pairs first,
   within 128-bit lanes (every lane then holds a partial sum of a, b, c, d),
   then the four 128-bit lanes added. */
static inline void mh_hsum4_f32_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float *out)
{
    /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d */
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: [a, b, c, d] */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
}

static inline void mh_hsum4_f64_avx512(__m512d a, __m512d b, __m512d c, __m512d d, double *out)
{
    /* per 128-bit lane: [a, b] and [c, d] */
    const __m512d ab = _mm512_add_pd(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
    const __m512d cd = _mm512_add_pd(_mm512_unpacklo_pd(c, d), _mm512_unpackhi_pd(c, d));
    const __m256d ab2 = _mm256_add_pd(_mm512_castpd512_pd256(ab), _mm512_extractf64x4_pd(ab, 1));
    const __m256d cd2 = _mm256_add_pd(_mm512_castpd512_pd256(cd), _mm512_extractf64x4_pd(cd, 1));
    _mm256_storeu_pd(out, _mm256_add_pd(_mm256_permute2f128_pd(ab2, cd2, 0x20),
                                        _mm256_permute2f128_pd(ab2, cd2, 0x31)));
}


/* r[0..16) transposed in place: afterwards r[c][i] holds what r[i][c] held.
   Pairs of rows are interleaved within 128-bit lanes, then groups of four
   rows, then the 128-bit lanes are gathered across registers in two steps. */
static inline void mh_transpose_f32_avx512(__m512 r[16])
{
    __m512 t[16], u[16];
    for (int k = 0; k < 8; ++k) {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    /* u[4k + m], 128-bit lane L: column 4L + m of rows 4k .. 4k+3 */
    for (int k = 0; k < 4; ++k) {
        u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
        u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
    }
    for (int m = 0; m < 4; ++m) {
        const __m512 lo_a = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44);
        const __m512 hi_a = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
        const __m512 lo_b = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
        const __m512 hi_b = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_f32x4(lo_a, lo_b, 0x88);
        r[4 + m] = _mm512_shuffle_f32x4(lo_a, lo_b, 0xDD);
        r[8 + m] = _mm512_shuffle_f32x4(hi_a, hi_b, 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(hi_a, hi_b, 0xDD);
    }
}

static inline void mh_transpose_f64_avx512(__m512d r[8])
{
    __m512d t[8];
    for (int k = 0; k < 4; ++k) {
        t[2 * k] = _mm512_unpacklo_pd(r[2 * k], r[2 * k + 1]);     /* even columns */
        t[2 * k + 1] = _mm512_unpackhi_pd(r[2 * k], r[2 * k + 1]); /* odd columns */
    }
    for (int p = 0; p < 2; ++p) {
        const __m512d lo_a = _mm512_shuffle_f64x2(t[p], t[2 + p], 0x44);
        const __m512d hi_a = _mm512_shuffle_f64x2(t[p], t[2 + p], 0xEE);
        const __m512d lo_b = _mm512_shuffle_f64x2(t[4 + p], t[6 + p], 0x44);
        const __m512d hi_b = _mm512_shuffle_f64x2(t[4 + p], t[6 + p], 0xEE);
        r[p] = _mm512_shuffle_f64x2(lo_a, lo_b, 0x88);
        r[2 + p] = _mm512_shuffle_f64x2(lo_a, lo_b, 0xDD);
        r[4 + p] = _mm512_shuffle_f64x2(hi_a, hi_b, 0x88);
        r[6 + p] = _mm512_shuffle_f64x2(hi_a, hi_b, 0xDD);
    }
}

/* ---------------------------------------------------------------- float32 */
#define T float
#define V __m512
#define VW 16
/* Register tiles for 32 vector registers.  Score tile: NVQ x JR accumulators
   plus NVQ query vectors and one broadcast key, 4x6 = 24 + 4 + 1 = 29 (a
   whole 64-row query block per key).  Output tile: NVO value vectors x IR
   rows, 4x6 the same way.  Measured one thread, causal, D=64, T=1024 (GF/s
   relative to 4x6/4x6): score 2x12 and 2x8 equal within 1%, 4x4 and 4x5 -3%,
   4x7 -8%, 4x3 -12%; output 4x4, 4x5 and 2x12 -2%, 2x8 -3%, 4x7 -5%, 4x3 -35%. */
#define NVQ 4
#define JR 6
#define NVO 4
#define IR 6
#define FN(x) MH_SFX(x##_f32)
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(x) _mm512_set1_ps(x)
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_DIV(a, b) _mm512_div_ps((a), (b))
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_EXP(x) mh_exp_f32_avx512(x)
#define V_HSUM(x) _mm512_reduce_add_ps(x)
#define V_HSUM4(a, b, c, d, out) mh_hsum4_f32_avx512((a), (b), (c), (d), (out))
#define V_TRANSPOSE(r) mh_transpose_f32_avx512(r)
#define V_LOAD_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define V_LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define V_LOAD_U4(p) mh_load_u4_avx512((const uint8_t *)(p))
#define VI8 mh_i8w_avx512
#define V_I8_WIDEN(p) mh_i8_widen_avx512(p)
#define V_I8_DOT(W, xp) mh_i8_dot_avx512(&(W), (xp))
#define V_LOAD_I8_PAIRS(p, e, o) mh_load_i8_pairs_avx512((p), &(e), &(o))
/* int4 groups in split order (mh_few_rows.h, FN(u4_row)) */
#define V_LOAD_U4_GROUP(p, u) mh_load_u4_split_avx512((const uint8_t *)(p), &(u)[0], &(u)[1])
#define V_SPLIT_GROUP(u) mh_split_avx512(&(u)[0], &(u)[1])
#define V_UNSPLIT_GROUP(u) mh_unsplit_avx512(&(u)[0], &(u)[1])
#define V_STORE_BF16(p, x) _mm256_storeu_si256((__m256i *)(p), mh_to_bf16_avx512(x))
#define V_STORE_HALF(p, x) \
    _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define S_HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define S4_HALF_TO_FLOAT(dst, src) \
    _mm_storeu_ps((dst), _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(src))))
#define V_NEG_INF_TO_ZERO(x) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), (x), \
                         _mm512_setzero_ps())
/* hidden entries (mh_common.h): lanes whose sign bit is clear are visible */
#define V_MARK_HIDDEN(p, s) \
    _mm512_mask_mov_ps((p), _mm512_cmp_ps_mask((s), _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), \
                       _mm512_set1_ps(-0.0f))
#define VM __mmask16
#define V_VISIBLE(p) _mm512_cmpge_epi32_mask(_mm512_castps_si512(p), _mm512_setzero_si512())
#define V_FMA_VISIBLE(a, b, c, m) _mm512_mask3_fmadd_ps((a), (b), (c), (m))
#define V_WHERE_SMALL(x, t, a, b) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(x), (t), _CMP_LT_OQ), (b), (a))

/* A blocked int8 pass (mh_linear_index) for 16 columns, as the AVX2 path does it for
   8 (16-bit multiply-adds of 512 bits need AVX512-BW, which this path does not
   require): each 8-column half of the four pairs of rows (32 bytes a pair) widened to
   16 bits, multiplied by its pair of 16-bit integers (the lanes of xp[j]) and added
   (madd), exactly; the halves joined and converted to float. */
#ifdef MH_AVX512_DPBF16
/* With AVX512-BW (the avx512bf16 path): each pair of rows of the 16 columns (32 bytes)
   widened to 16 bits in one 512-bit register, multiplied by its pair of 16-bit integers
   and added (madd) into the column's 32-bit lane: half the instructions of the two
   halves below, and the same exact integer sums.  One row of 576 x 3072 with the
   weights in cache: 1.25-1.3x on an Intel Xeon, one or two threads.  The first pair's
   madd starts the sum and VNNI's fused multiply-add of pairs (vpdpwssd, which this
   path's CPUs have) adds the other three: the same sums (8 products of at most
   128 * 32767 cannot overflow 32 bits) with three instructions fewer.  Weights from
   memory, on an Intel Xeon (2 threads, alternating in one process, the same bits): one
   row of 576 x 3072, 576 x 49152 and 1536 x 576 0.98-1.0x the time; a whole int8
   SmolLM2-shaped model decoding 1.01-1.06x the tokens/s (processes alternating). */
typedef struct { __m512i w[4]; } mh_i8w_avx512;
static inline mh_i8w_avx512 mh_i8_widen_avx512(const int8_t *p)
{
    mh_i8w_avx512 W;
    for (int j = 0; j < 4; ++j)
        W.w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * j)));
    return W;
}
static inline __m512 mh_i8_dot_avx512(const mh_i8w_avx512 *W, const __m512 *xp)
{
    __m512i s = _mm512_madd_epi16(W->w[0], _mm512_castps_si512(xp[0]));
    for (int j = 1; j < 4; ++j) s = _mm512_dpwssd_epi32(s, W->w[j], _mm512_castps_si512(xp[j]));
    return _mm512_cvtepi32_ps(s);
}
#else
typedef struct { __m256i lo[4], hi[4]; } mh_i8w_avx512;
static inline mh_i8w_avx512 mh_i8_widen_avx512(const int8_t *p)
{
    mh_i8w_avx512 W;
    for (int j = 0; j < 4; ++j) {
        W.lo[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 32 * j)));
        W.hi[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 32 * j + 16)));
    }
    return W;
}
static inline __m512 mh_i8_dot_avx512(const mh_i8w_avx512 *W, const __m512 *xp)
{
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i x = _mm512_castsi512_si256(_mm512_castps_si512(xp[j]));
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(W->lo[j], x));
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(W->hi[j], x));
    }
    return _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}
#endif

/* The pair of rows of 16 blocked int8 columns at p (32 bytes, even row first in each
   column) as floats: the even row in *e, the odd one in *o. */
static inline void mh_load_i8_pairs_avx512(const int8_t *p, __m512 *e, __m512 *o)
{
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i w2 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    /* w: columns 0-7 as (even, odd) pairs; w2: columns 8-15 */
    const __m512i idx_e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i idx_o = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *e = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(w, idx_e, w2));
    *o = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(w, idx_o, w2));
}

/* x rounded to bfloat16 bits (nearest even; NaN: the high half with the quiet
   bit set), as mh_float_to_bf16 does lane by lane.  (vcvtneps2bf16 would treat
   float32 subnormals as 0.) */
static inline __m256i mh_to_bf16_avx512(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    const __m512i r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                              _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16),
                                              _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 four-bit values from 8 bytes (low nibble first) as floats. */
static inline __m512 mh_load_u4_avx512(const uint8_t *p)
{
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), low4 = _mm_set1_epi8(0x0f);
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(b, low4),
                                          _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib));
}

/* 32 four-bit values from 16 bytes in split order: the low nibbles (even
   channels) in *lo, the high ones (odd channels) in *hi. */
static inline void mh_load_u4_split_avx512(const uint8_t *p, __m512 *lo, __m512 *hi)
{
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
}

/* channels 0-15 in *a and 16-31 in *b, to split order (even channels in *a,
   odd in *b), and back */
static inline void mh_split_avx512(__m512 *a, __m512 *b)
{
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512 e = _mm512_permutex2var_ps(*a, even, *b);
    *b = _mm512_permutex2var_ps(*a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), *b);
    *a = e;
}
static inline void mh_unsplit_avx512(__m512 *a, __m512 *b)
{
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512 x = _mm512_permutex2var_ps(*a, lo, *b);
    *b = _mm512_permutex2var_ps(*a, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), *b);
    *a = x;
}

/* exp(x) (scheme and constants in mh_exp.h), 2^n applied with scalef.  Inputs
   are clamped where 2^n underflows to exactly 0, so exp(-inf) = 0; NaN passes
   through (max returns its second operand when one operand is NaN). */
static inline __m512 mh_exp_f32_avx512(__m512 x)
{
    __m512 xc = _mm512_max_ps(_mm512_set1_ps(MH_EXPF_SCALEF_MIN_ARG), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(MH_EXPF_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(MH_EXPF_LN2_HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(MH_EXPF_LN2_LO), r);
    __m512 p = _mm512_set1_ps(MH_EXPF_P6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(MH_EXPF_P5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(MH_EXPF_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(MH_EXPF_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(MH_EXPF_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(MH_EXPF_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(MH_EXPF_P0));
    return _mm512_scalef_ps(p, n);
}

/* 2^x for x <= 0 or NaN (mh_exp.h), 2^n applied with scalef. */
static inline __m512 mh_exp2_f32_avx512(__m512 x)
{
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(MH_EXP2F_SCALEF_MIN_ARG), x);
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_set1_ps(MH_EXP2F_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(MH_EXP2F_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(MH_EXP2F_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(MH_EXP2F_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(MH_EXP2F_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(MH_EXP2F_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(MH_EXP2F_C0));
    return _mm512_scalef_ps(p, n);
}
#define V_EXP2(x) mh_exp2_f32_avx512(x)

#ifdef MH_AVX512_DPBF16
/* bfloat16 pairs: a VP holds 16 32-bit words, each two bfloat16 numbers (low
   half first).  V_DPBF16(acc, a, b): acc[l] += a.lo[l]*b.lo[l] + a.hi[l]*b.hi[l]
   (vdpbf16ps: the products are exact in float32, the sums round to nearest;
   bfloat16 subnormals count as 0, float32 subnormal sums become 0). */
#define VP __m512i
#define VP_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VP_STORE(p, x) _mm512_storeu_si512((void *)(p), (x))
#define VP_SET1(w) _mm512_set1_epi32((int)(w))
#define V_DPBF16(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
/* the low / high numbers of each pair, widened to float */
#define VP_LOW(x) _mm512_castsi512_ps(_mm512_slli_epi32((x), 16))
#define VP_HIGH(x) _mm512_castsi512_ps(_mm512_and_si512((x), _mm512_set1_epi32((int)0xffff0000u)))
#define VP_AS_V(x) _mm512_castsi512_ps(x)
#define VP_PAIR(lo, hi) mh_pair_bf16_avx512((lo), (hi))
#define VP_INTERLEAVE(dst, r0, r1, n, nw) mh_interleave_bf16_avx512((dst), (r0), (r1), (n), (nw))

/* word l = (bf16(lo[l]), bf16(hi[l])), rounded to nearest even. */
static inline __m512i mh_pair_bf16_avx512(__m512 lo, __m512 hi)
{
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* dst[e] = (r0[e], r1[e]) as bfloat16 words for e < n (r1 NULL: 0), 0 for
   n <= e < nw (nw a multiple of 16). */
static inline void mh_interleave_bf16_avx512(uint32_t *dst, const uint16_t *r0,
                                             const uint16_t *r1, int64_t n, int64_t nw)
{
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t e = 0; e < nw; e += 32) {
        const int64_t m = n - e <= 0 ? 0 : (n - e >= 32 ? 32 : n - e);
        const __mmask32 k = m == 32 ? 0xffffffffu : (__mmask32)((1u << m) - 1u);
        const __m512i a = _mm512_maskz_loadu_epi16(k, r0 + e);
        const __m512i b = r1 ? _mm512_maskz_loadu_epi16(k, r1 + e) : _mm512_setzero_si512();
        _mm512_storeu_si512((void *)(dst + e), _mm512_permutex2var_epi16(a, lo, b));
        if (e + 16 < nw) _mm512_storeu_si512((void *)(dst + e + 16), _mm512_permutex2var_epi16(a, hi, b));
    }
}
#endif

/* what this instantiation can do (mh_instance.h); 16 lanes read an int4 group
   in split order, and the avx512bf16 build adds bfloat16 pair products */
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
#ifdef MH_AVX512_DPBF16
#define MH_HAS_BF16_DOT 1
#define MH_HAS_I4_DOTS 1 /* int4 keys by VNNI integer dot products (mh_i4_dots.h) */
#endif
#include "mh_instance.h"

#ifdef MH_AVX512_DPBF16
/* float64 has no pair products: this path's float64 entries are the avx512 path's, and
   this second compile (the slowest file of the build) makes only float32's */
void mh_block_item_f64_avx512(const mh_attn_args *a, int64_t pair, int64_t q0, void *scratch);
void mh_split_item_f64_avx512(const mh_attn_args *a, int64_t pair, int64_t range, void *scratch);
void mh_merge_item_f64_avx512(const mh_attn_args *a, int64_t pair, void *scratch);
void mh_linear_rows_item_f64_avx512(const mh_linear_args *a, int64_t item);
void mh_exp_array_f64_avx512(const double *x, double *y, int64_t n);
extern const mh_caps mh_caps_f64_avx512;
MH_KERNEL_TABLE_F64_OF(avx512bf16, avx512)
#else
/* ---------------------------------------------------------------- float64 */
#define T double
#define V __m512d
#define VW 8
/* the same tiles: for float64 every other shape measured within 3% (4x4,
   2x12, 4x5 score; 4x4, 2x8, 4x5 output) */
#define NVQ 4
#define JR 6
#define NVO 4
#define IR 6
#define FN(x) MH_SFX(x##_f64)
#define V_ZERO() _mm512_setzero_pd()
#define V_SET1(x) _mm512_set1_pd(x)
#define V_LOAD(p) _mm512_loadu_pd(p)
#define V_STORE(p, v) _mm512_storeu_pd((p), (v))
#define V_ADD(a, b) _mm512_add_pd((a), (b))
#define V_SUB(a, b) _mm512_sub_pd((a), (b))
#define V_MUL(a, b) _mm512_mul_pd((a), (b))
#define V_DIV(a, b) _mm512_div_pd((a), (b))
#define V_MAX(a, b) _mm512_max_pd((a), (b))
#define V_FMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define V_EXP(x) mh_exp_f64_avx512(x)
#define V_HSUM(x) _mm512_reduce_add_pd(x)
#define V_HSUM4(a, b, c, d, out) mh_hsum4_f64_avx512((a), (b), (c), (d), (out))
#define V_TRANSPOSE(r) mh_transpose_f64_avx512(r)
#define V_NEG_INF_TO_ZERO(x) \
    _mm512_mask_blend_pd(_mm512_cmp_pd_mask((x), _mm512_set1_pd(-INFINITY), _CMP_EQ_OQ), (x), \
                         _mm512_setzero_pd())
#define V_MARK_HIDDEN(p, s) \
    _mm512_mask_mov_pd((p), _mm512_cmp_pd_mask((s), _mm512_set1_pd(-INFINITY), _CMP_EQ_OQ), \
                       _mm512_set1_pd(-0.0))
#define VM __mmask8
#define V_VISIBLE(p) _mm512_cmpge_epi64_mask(_mm512_castpd_si512(p), _mm512_setzero_si512())
#define V_FMA_VISIBLE(a, b, c, m) _mm512_mask3_fmadd_pd((a), (b), (c), (m))
#define V_WHERE_SMALL(x, t, a, b) \
    _mm512_mask_blend_pd(_mm512_cmp_pd_mask(_mm512_abs_pd(x), (t), _CMP_LT_OQ), (b), (a))

/* exp(x) in double (scheme and constants in mh_exp.h), 2^n with scalef. */
static inline __m512d mh_exp_f64_avx512(__m512d x)
{
    const __m512d lo = _mm512_set1_pd(MH_EXP_MIN_ARG);
    __m512d xc = _mm512_max_pd(lo, x);
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(xc, _mm512_set1_pd(MH_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(MH_EXP_LN2_HI), xc);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(MH_EXP_LN2_LO), r);
    __m512d p = _mm512_set1_pd(mh_exp_f64_poly[0]);
    for (int i = 1; i <= MH_EXP_DEGREE; ++i)
        p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(mh_exp_f64_poly[i]));
    __m512d y = _mm512_scalef_pd(p, n);
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_pd());
}

/* 2^x in double for x <= 0 or NaN (mh_exp.h), 2^n applied with scalef. */
static inline __m512d mh_exp2_f64_avx512(__m512d x)
{
    const __m512d xc = _mm512_max_pd(_mm512_set1_pd(MH_EXP2_SCALEF_MIN_ARG), x);
    const __m512d n = _mm512_roundscale_pd(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d f = _mm512_sub_pd(xc, n);
    __m512d p = _mm512_set1_pd(mh_exp2_f64_poly[0]);
    for (int i = 1; i <= MH_EXP_DEGREE; ++i)
        p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(mh_exp2_f64_poly[i]));
    return _mm512_scalef_pd(p, n);
}
#define V_EXP2(x) mh_exp2_f64_avx512(x)

/* what this instantiation can do (mh_instance.h) */
#define MH_HAS_EXP2 1
#define MH_HAS_TRANSPOSE 1
#define MH_HAS_HSUM4 1
#define MH_HAS_SELECT 1
#include "mh_instance.h"

MH_KERNEL_TABLE(avx512)
#endif /* MH_AVX512_DPBF16 */
#else
MH_EMPTY_TABLE(avx512)
#endif
