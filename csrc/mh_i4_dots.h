/*
 * int4 keys by integer dot products (MH_HAS_I4_DOTS: the avx512bf16 path, whose
 * CPUs all have AVX512-VNNI).  Included by mh_few_rows.h in the float32
 * instantiation only.
 *
 * Widening 4-bit keys to float and multiplying them costs about as many
 * instructions a key as int8's (FN(i4_key_lanes)), so int4 keys were read no
 * faster than int8 ones although they take half the bytes.  Here a
 * query row is written once per call as a 24-bit integer per channel,
 * Q = round(q / dq) with dq = max|q| / MH_I4_QMAX, in three signed bytes
 * (balanced digits, Q = d0 2^16 + d1 2^8 + d2).  Two keys' 64 channels
 * each, side by side in one register, are a shift and two masks away from
 * their low and high nibbles as unsigned bytes: six vpdpbusd and two shifts
 * give each group's sum of Q times the keys' 4-bit values, exactly, in
 * 32-bit lanes (a register a key took half as many lanes' work but twice
 * the loads, masks and lane sums: 1.03-1.06x less time a step with two).
 * The score is then
 *     dq (s0 I0 + s1 I1 + ...) + (m0 qs0 + m1 qs1 + ...)
 * with (s, m) the group's scale and min and qs the group's sum of q.  The
 * only error added to the float path's is the rounding of q to dq / 2,
 * 2^-24 of the row's largest channel: the size of float32's own rounding.
 * A row whose largest channel is not finite (or is so small that dq would
 * be subnormal) keeps the float path, and so does NaN's propagation.
 */

#define MH_I4_QMAX 8323072.0f /* 2^23 - 2^16: three balanced digits hold it */
/* the mix's weights are not negative: 24-bit integers in three unsigned digits
   (2^24 - 2^8: a weight of the largest's size, rounded, stays below 2^24) */
#define MH_I4_WMAX 16776960.0f
/* Whether rows r hold two groups side by side (64 channels, as a cache's rows):
   the key dots and the mix then load two rows at once.  Both loads together:
   an int4 step 1.03-1.04x less time with its cache in L3, 1.02-1.03x with
   layers stepped in turn (12 heads, L = 16384, AMD EPYC with AVX-512). */
#define MH_I4_ADJACENT(r) ((r).row_bytes == 2 * (MH_I4_GROUP / 2))
/* where a row's digits are kept: after the query sums in kpack ([BQ][16]
   floats), E / 64 blocks of 3 x 64 bytes a row */
#define MH_I4_DIGITS(kpack, i, E) \
    ((int8_t *)((kpack) + MH_BLOCK_Q * MH_I4_MAX_GROUPS) + (i) * ((E) / 64) * 192)
/* a row's dq, beside its group sums (the rows this path takes have <= 8 groups) */
#define MH_I4_DQ_SLOT (MH_I4_MAX_GROUPS - 1)

/* Whether this path serves a call: keys of whole 64-channel blocks and at most
   8 groups.  The digits and dq then fit in kpack (mh_scratch_plan: BK x E
   floats; the sums take BQ x 16 floats, the digits of at most BQ rows
   BQ x 3E / 4, and BQ = BK = 64). */
MH_INLINE int FN(i4_dots_fit)(int64_t E) { return E % 64 == 0 && E <= 256; }
typedef char FN(i4_dots_blocks)[MH_BLOCK_Q == 64 && MH_BLOCK_K == 64 ? 1 : -1];

/* Row i's digits from its scaled query row qi (in split order, FN(u4_row)):
   each 64-channel block as the keys' bytes come (FN(i4_dots16)), the low
   nibbles (even channels of both groups) then the high ones.  Stores dq in
   kpack[i][MH_I4_DQ_SLOT], or -1 when the row keeps the float path. */
static void FN(i4_digits)(const T *qi, int64_t E, T *kpack, int64_t i)
{
    __m512 mx = _mm512_setzero_ps();
    for (int64_t d = 0; d < E; d += 16)
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qi + d)));
    const float m = _mm512_reduce_max_ps(mx); /* (max of NaN and x may be x: checked below) */
    int ok = m == m && m < INFINITY && (m == 0.0f || m > 1e-30f);
    for (int64_t d = 0; ok && d < E; ++d) ok = qi[d] == qi[d];
    if (!ok) {
        kpack[i * MH_I4_MAX_GROUPS + MH_I4_DQ_SLOT] = -1.0f;
        return;
    }
    kpack[i * MH_I4_MAX_GROUPS + MH_I4_DQ_SLOT] = m / MH_I4_QMAX;
    const __m512 inv = _mm512_set1_ps(m > 0 ? MH_I4_QMAX / m : 0.0f);
    const __m512i h = _mm512_set1_epi32(128), lo8 = _mm512_set1_epi32(255);
    int8_t *dig = MH_I4_DIGITS(kpack, i, E);
    for (int64_t c = 0; c < E / 64; ++c) {
        /* split order: group 2c's even 16, its odd 16, group 2c+1's even, odd */
        static const int src[4] = {0, 32, 16, 48}; /* evens g0, evens g1, odds g0, odds g1 */
        for (int part = 0; part < 4; ++part) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qi + c * 64 + src[part]), inv);
            __m512i q = _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i d2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, h), lo8), h);
            q = _mm512_srai_epi32(_mm512_sub_epi32(q, d2), 8);
            const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, h), lo8), h);
            const __m512i d0 = _mm512_srai_epi32(_mm512_sub_epi32(q, d1), 8);
            int8_t *o = dig + c * 192 + part * 16;
            _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(d0));
            _mm_storeu_si128((__m128i *)(o + 64), _mm512_cvtepi32_epi8(d1));
            _mm_storeu_si128((__m128i *)(o + 128), _mm512_cvtepi32_epi8(d2));
        }
    }
}

/* The (scale, min) pairs of groups 2c and 2c+1 of 16 rows, 8 bytes a row at
   sp + j * scale_bytes: S0, M0 (group 2c) and S1, M1 (2c+1), a lane a row. */
MH_INLINE void FN(i4_pairs16)(const char *sp, int64_t scale_bytes, __m512 *S0, __m512 *M0,
                              __m512 *S1, __m512 *M1)
{
    __m512i pr[2];
    if (scale_bytes == 8) {
        pr[0] = _mm512_loadu_si512((const void *)sp);
        pr[1] = _mm512_loadu_si512((const void *)(sp + 64));
    } else {
        const int64_t b = scale_bytes;
        const __m512i off = _mm512_setr_epi64(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
        pr[0] = _mm512_i64gather_epi64(off, (const void *)sp, 1);
        pr[1] = _mm512_i64gather_epi64(off, (const void *)(sp + 8 * b), 1);
    }
    /* each row's four halves (s0, m0, s1, m1): X0 the s0 of rows 0-15 then their m0,
       X1 their s1 then their m1, still float16; then widened (two permutes of the
       halves instead of four of the widened floats and four block shuffles: the
       same bits, and an int4 decode call over cold caches 0.98-0.99x the time) */
    static const uint16_t take[32] = {0, 4, 8,  12, 16, 20, 24, 28, 32, 36, 40,
                                      44, 48, 52, 56, 60, 1,  5,  9,  13, 17, 21,
                                      25, 29, 33, 37, 41, 45, 49, 53, 57, 61};
    const __m512i t0 = _mm512_loadu_si512((const void *)take);
    const __m512i X0 = _mm512_permutex2var_epi16(pr[0], t0, pr[1]);
    const __m512i X1 =
        _mm512_permutex2var_epi16(pr[0], _mm512_add_epi16(t0, _mm512_set1_epi16(2)), pr[1]);
    *S0 = _mm512_cvtph_ps(_mm512_castsi512_si256(X0));
    *M0 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(X0, 1));
    *S1 = _mm512_cvtph_ps(_mm512_castsi512_si256(X1));
    *M1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(X1, 1));
}

/* Row i's scores of 16 keys (row j at k.base + j * k.row_bytes) into s[0..16),
   through the digits (FN(i4_digits)), the query's group sums qs (raw sums) and
   dq.  `pf` rows [0, 16) are prefetched.  `adjacent`: MH_I4_ADJACENT(k), a constant
   where the caller tests it once for all its runs of 16. */
MH_INLINE void FN(i4_dots16)(const int8_t *dig, const T *qs, T dq, FN(kv_rows) k, int64_t E,
                             T *s, FN(kv_rows) pf, const int adjacent)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i idx_g0 =
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27);
    const __m512i idx_g1 = _mm512_add_epi32(idx_g0, _mm512_set1_epi32(4));
    FN(prefetch_rows)(pf, 0, 16);
    __m512 score = _mm512_setzero_ps();
    for (int64_t c = 0; c < E / 64; ++c) {
        /* each digit's bytes for the low nibbles (its first 32) twice, and for the high
           ones (its last 32) twice: two keys' bytes side by side meet them */
        __m512i Dl[3], Dh[3];
        for (int d = 0; d < 3; ++d) {
            const int8_t *dd = dig + c * 192 + 64 * d;
            Dl[d] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)dd));
            Dh[d] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(dd + 32)));
        }
        /* two keys a register: A[t]'s 128-bit blocks hold keys 2t (group 0, 1) and
           2t + 1 (group 0, 1), each lane 8 products (a key's low and high nibbles) */
        __m512i A[8];
        for (int t = 0; t < 8; ++t) {
            const char *kr = k.base + 2 * t * k.row_bytes + c * 32;
            const __m512i b =
                adjacent
                    ? _mm512_loadu_si512((const void *)kr)
                    : _mm512_inserti64x4(
                          _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)kr)),
                          _mm256_loadu_si256((const __m256i *)(kr + k.row_bytes)), 1);
            const __m512i lo = _mm512_and_si512(b, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
            __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, Dl[0]);
            a = _mm512_slli_epi32(_mm512_dpbusd_epi32(a, hi, Dh[0]), 8);
            a = _mm512_slli_epi32(
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a, lo, Dl[1]), hi, Dh[1]), 8);
            A[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a, lo, Dl[2]), hi, Dh[2]);
        }
        /* each block's four lanes summed: two in integers (at most 16 products of a
           24-bit Q by 15: no overflow), then in float; Z[h]'s lane 4j + i is block j of
           A[4h + i] (keys 8h + 2i and 8h + 2i + 1) */
        __m512 Z[2];
        for (int h = 0; h < 2; ++h) {
            const __m512i *X = A + 4 * h;
            const __m512 F01 = _mm512_cvtepi32_ps(_mm512_add_epi32(
                _mm512_unpacklo_epi32(X[0], X[1]), _mm512_unpackhi_epi32(X[0], X[1])));
            const __m512 F23 = _mm512_cvtepi32_ps(_mm512_add_epi32(
                _mm512_unpacklo_epi32(X[2], X[3]), _mm512_unpackhi_epi32(X[2], X[3])));
            const __m512d P01 = _mm512_castps_pd(F01), P23 = _mm512_castps_pd(F23);
            Z[h] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(P01, P23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(P01, P23)));
        }
        const __m512 G0 = _mm512_permutex2var_ps(Z[0], idx_g0, Z[1]);
        const __m512 G1 = _mm512_permutex2var_ps(Z[0], idx_g1, Z[1]);
        __m512 S0, M0, S1, M1;
        FN(i4_pairs16)(k.scale + c * 8, k.scale_bytes, &S0, &M0, &S1, &M1);
        const __m512 dots = _mm512_fmadd_ps(S1, G1, _mm512_mul_ps(S0, G0));
        const __m512 mins = _mm512_fmadd_ps(M1, _mm512_set1_ps(qs[2 * c + 1]),
                                            _mm512_mul_ps(M0, _mm512_set1_ps(qs[2 * c])));
        score = _mm512_add_ps(score, _mm512_fmadd_ps(dots, _mm512_set1_ps(dq), mins));
    }
    _mm512_storeu_ps(s, score);
}


/*
 * int4 values by integer dot products.  The mix adds p_j (s_j u_j + m_j) over
 * a block's value rows j for each channel, and widening every 4-bit value to
 * float for its multiply-add took most of an int4 decode step's time.  Here a
 * query row's weights W_j = p_j s_j of one group are written as 24-bit
 * integers on one scale for the block's rows, Q_j = round(W_j / dq) with
 * dq = max W / MH_I4_WMAX (each group its own: its channels are outputs of
 * their own, whose scales may differ by decades), in three unsigned bytes
 * (the weights are not negative; balanced signed digits, as the keys' query
 * digits above, took 1.02x more time a step).  Four value rows' bytes are
 * interleaved so that each 32-bit lane holds one channel of the four rows,
 * and vpdpbusd multiplies the four rows' digits by their four 4-bit values
 * and adds them: three 32-bit accumulators a lane (one per digit) hold
 * 16 x 4 x 255 x 15 at most over a block of 64 rows, exactly, and their
 * weighted sum, times dq, is the group's part of the mix.  The sums of
 * p_j m_j come along in float.  The error added to the float path's is the
 * rounding of each W_j to dq / 2, 2^-25 of the group's largest weight in the
 * block, below float32's rounding of the sum it goes in.
 *
 * Two ways to interleave, with the same sums and so the same results:
 * shuffles (AVX512-BW: six for four rows, and each digit's register a
 * broadcast merged under a mask), or, on CPUs with AVX512-VBMI (the plan's
 * i4_permutes), two byte permutes that put the two groups in alternate lanes,
 * so that a digit's register is one plain 8-byte broadcast; the weights' digits
 * then come out of one permute too.  An int4 decode call over cold caches
 * (12 heads of 64, L = 16384, 2 threads, 512 MiB of caches attended in turn,
 * medians of 15 rounds alternating in one process, an Intel Xeon with AMX)
 * took 0.94-0.98x the time with the permutes, in six runs: cold, the pace of
 * this loop sets the pace of the memory requests (docs/performance.md).
 */

/* acc += the dot products of X's unsigned and Y's signed bytes, four a lane, in
   acc's own register (gcc 12 otherwise copies each of the mix's twelve
   accumulators to a new register at every step) */
#if defined(__GNUC__) && !defined(__clang__)
#define MH_DPBUSD_TO(acc, X, Y) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(X), "v"(Y))
#else
#define MH_DPBUSD_TO(acc, X, Y) ((acc) = _mm512_dpbusd_epi32((acc), (X), (Y)))
#endif

/* the functions that use the byte permutes (MSVC takes their intrinsics anywhere) */
#if defined(__GNUC__) || defined(__clang__)
#define MH_TARGET_VBMI __attribute__((target("avx512vbmi")))
#else
#define MH_TARGET_VBMI
#endif

/* One query row's weights of a block's value rows for two groups, as digits; pm[g]
   the sum of p_j m_jg. */
typedef struct {
    union {
        /* shuffles: [d][g][j] digit d (most significant first) of row j's weight of
           group g (for MH_I4_ADJACENT rows, each four rows in the order 0, 2, 1, 3) */
        uint8_t planes[3][2][MH_BLOCK_K];
        /* byte permutes: rows 4i .. 4i+3 at [i], digit d at 8 d: group 0's four rows,
           then group 1's (8 bytes unused) */
        uint8_t quads[MH_BLOCK_K / 4][32];
    } dig;
    T dq[2], pm[2];
} FN(i4_mix_w);

/* The weights W[g][b] (rows 16b .. 16b+15) of groups g0 and g0 + 1 of value rows v,
   their largest m[g], and w->pm, w->dq.  Returns 0 when a weight is not finite or
   the largest is so small that dq would be subnormal: the float path then takes
   the block. */
MH_INLINE int FN(i4_mix_scaled)(const T *p, FN(kv_rows) v, int64_t g0, int64_t n16,
                                __m512 W[2][MH_BLOCK_K / 16], float m[2], FN(i4_mix_w) *w)
{
    __m512 mx0 = _mm512_setzero_ps(), mx1 = mx0, pm0 = mx0, pm1 = mx0;
    __mmask16 bad = 0;
    for (int64_t b = 0; b < n16 / 16; ++b) {
        __m512 S0, M0, S1, M1;
        FN(i4_pairs16)(v.scale + 16 * b * v.scale_bytes + g0 * 4, v.scale_bytes, &S0, &M0,
                       &S1, &M1);
        const __m512 P = _mm512_loadu_ps(p + 16 * b);
        W[0][b] = _mm512_mul_ps(P, S0);
        W[1][b] = _mm512_mul_ps(P, S1);
        pm0 = _mm512_fmadd_ps(P, M0, pm0);
        pm1 = _mm512_fmadd_ps(P, M1, pm1);
        /* (W >= 0: p >= 0 and the scales are not negative; NaN is unordered) */
        bad |= _mm512_cmp_ps_mask(W[0][b], W[0][b], _CMP_UNORD_Q) |
               _mm512_cmp_ps_mask(W[1][b], W[1][b], _CMP_UNORD_Q);
        mx0 = _mm512_max_ps(mx0, W[0][b]);
        mx1 = _mm512_max_ps(mx1, W[1][b]);
    }
    m[0] = _mm512_reduce_max_ps(mx0);
    m[1] = _mm512_reduce_max_ps(mx1);
    w->pm[0] = _mm512_reduce_add_ps(pm0);
    w->pm[1] = _mm512_reduce_add_ps(pm1);
    if (bad) return 0;
    for (int g = 0; g < 2; ++g) {
        if (!(m[g] < INFINITY) || (m[g] != 0.0f && m[g] <= 1e-30f) ||
            !(w->pm[g] - w->pm[g] == 0.0f))
            return 0;
        /* (each group on its own scale: its channels are outputs of their own) */
        w->dq[g] = m[g] / MH_I4_WMAX;
    }
    return 1;
}

/* W / dq rounded: the 24-bit integers of weights W of a group whose largest is m */
MH_INLINE __m512i FN(i4_weight_ints)(__m512 W, float m)
{
    const __m512 inv = _mm512_set1_ps(m > 0 ? MH_I4_WMAX / m : 0.0f);
    return _mm512_cvt_roundps_epi32(_mm512_mul_ps(W, inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* The digits of row weights p[0..n16) (n16 a multiple of 16, at most BK) for
   groups g0 and g0 + 1 of value rows v, into *w's planes (FN(i4_mix_scaled)'s
   return value). */
static int FN(i4_mix_weights)(const T *p, FN(kv_rows) v, int64_t g0, int64_t n16,
                              FN(i4_mix_w) *w)
{
    __m512 W[2][MH_BLOCK_K / 16];
    float m[2];
    if (!FN(i4_mix_scaled)(p, v, g0, n16, W, m, w)) return 0;
    /* (rows read a pair a load: each four rows' digits in the order 0, 2, 1, 3) */
    const __m512i order = MH_I4_ADJACENT(v) ? _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10,
                                                                 9, 11, 12, 14, 13, 15)
                                            : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                 10, 11, 12, 13, 14, 15);
    for (int g = 0; g < 2; ++g)
        for (int64_t b = 0; b < n16 / 16; ++b) {
            const __m512i q = _mm512_permutexvar_epi32(order, FN(i4_weight_ints)(W[g][b], m[g]));
            /* (the truncating conversions keep each digit's byte) */
            uint8_t *o = w->dig.planes[0][g] + 16 * b;
            _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(_mm512_srli_epi32(q, 16)));
            _mm_storeu_si128((__m128i *)(o + 2 * MH_BLOCK_K),
                             _mm512_cvtepi32_epi8(_mm512_srli_epi32(q, 8)));
            _mm_storeu_si128((__m128i *)(o + 4 * MH_BLOCK_K), _mm512_cvtepi32_epi8(q));
        }
    return 1;
}

/* FN(i4_mix_weights) into *w's quads, by byte permutes. */
MH_TARGET_VBMI static int FN(i4_mix_weights_vbmi)(const T *p, FN(kv_rows) v, int64_t g0,
                                                  int64_t n16, FN(i4_mix_w) *w)
{
    /* byte k of two quads (rows 16b + 8h ..): quad k / 32, digit k % 32 / 8, group
       k % 8 / 4, row k % 4, from byte 2 - digit of that row's integer (group 1's
       register from index 64 on); the unused bytes take a zero byte */
    static const uint8_t take[2][64] = {
        {2,  6,  10, 14, 66, 70, 74, 78, 1,  5,  9,  13, 65, 69, 73, 77,
         0,  4,  8,  12, 64, 68, 72, 76, 3,  3,  3,  3,  3,  3,  3,  3,
         18, 22, 26, 30, 82, 86, 90, 94, 17, 21, 25, 29, 81, 85, 89, 93,
         16, 20, 24, 28, 80, 84, 88, 92, 3,  3,  3,  3,  3,  3,  3,  3},
        {34, 38, 42, 46, 98,  102, 106, 110, 33, 37, 41, 45, 97,  101, 105, 109,
         32, 36, 40, 44, 96,  100, 104, 108, 3,  3,  3,  3,  3,   3,   3,   3,
         50, 54, 58, 62, 114, 118, 122, 126, 49, 53, 57, 61, 113, 117, 121, 125,
         48, 52, 56, 60, 112, 116, 120, 124, 3,  3,  3,  3,  3,   3,   3,   3}};
    __m512 W[2][MH_BLOCK_K / 16];
    float m[2];
    if (!FN(i4_mix_scaled)(p, v, g0, n16, W, m, w)) return 0;
    const __m512i t0 = _mm512_loadu_si512((const void *)take[0]);
    const __m512i t1 = _mm512_loadu_si512((const void *)take[1]);
    for (int64_t b = 0; b < n16 / 16; ++b) {
        const __m512i q0 = FN(i4_weight_ints)(W[0][b], m[0]);
        const __m512i q1 = FN(i4_weight_ints)(W[1][b], m[1]);
        _mm512_storeu_si512((void *)w->dig.quads[4 * b], _mm512_permutex2var_epi8(q0, t0, q1));
        _mm512_storeu_si512((void *)w->dig.quads[4 * b + 2],
                            _mm512_permutex2var_epi8(q0, t1, q1));
    }
    return 1;
}

/* o[0..4) += the digits' sums a[d][u] (channel lanes u of digit d) scaled by
   dq, plus the sums of p m: o in split order (g0's even channels, its odd ones,
   then g0 + 1's), o[2h + e] from lanes idx[h] of a[.][e] and a[.][e + 2] */
MH_INLINE void FN(i4_mix_finish)(const FN(i4_mix_w) *w, const __m512i a[3][4], __m512i idx0,
                                 __m512i idx1, __m512 *o)
{
    const __m512 s16 = _mm512_set1_ps(65536.0f), s8 = _mm512_set1_ps(256.0f);
    __m512 F[4];
    for (int u = 0; u < 4; ++u)
        F[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[0][u]), s16,
                               _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[1][u]), s8,
                                               _mm512_cvtepi32_ps(a[2][u])));
    const __m512 dq0 = _mm512_set1_ps(w->dq[0]), dq1 = _mm512_set1_ps(w->dq[1]),
                 m0 = _mm512_set1_ps(w->pm[0]), m1 = _mm512_set1_ps(w->pm[1]);
    o[0] = _mm512_add_ps(o[0], _mm512_fmadd_ps(_mm512_permutex2var_ps(F[0], idx0, F[2]), dq0, m0));
    o[1] = _mm512_add_ps(o[1], _mm512_fmadd_ps(_mm512_permutex2var_ps(F[1], idx0, F[3]), dq0, m0));
    o[2] = _mm512_add_ps(o[2], _mm512_fmadd_ps(_mm512_permutex2var_ps(F[0], idx1, F[2]), dq1, m1));
    o[3] = _mm512_add_ps(o[3], _mm512_fmadd_ps(_mm512_permutex2var_ps(F[1], idx1, F[3]), dq1, m1));
}

/* the twelve accumulators a<d><u> (digit d of the weights times U[u]), variables
   rather than an array so that they stay in registers */
#define MH_I4_MIX_ACCS                                                                   \
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00,   \
            a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00
#define MH_I4_MIX_DOTS(D, U0, U1, U2, U3)                                               \
    do {                                                                                 \
        MH_DPBUSD_TO(a00, D[0], U0); MH_DPBUSD_TO(a01, D[0], U1);                       \
        MH_DPBUSD_TO(a02, D[0], U2); MH_DPBUSD_TO(a03, D[0], U3);                       \
        MH_DPBUSD_TO(a10, D[1], U0); MH_DPBUSD_TO(a11, D[1], U1);                       \
        MH_DPBUSD_TO(a12, D[1], U2); MH_DPBUSD_TO(a13, D[1], U3);                       \
        MH_DPBUSD_TO(a20, D[2], U0); MH_DPBUSD_TO(a21, D[2], U1);                       \
        MH_DPBUSD_TO(a22, D[2], U2); MH_DPBUSD_TO(a23, D[2], U3);                       \
    } while (0)
#define MH_I4_MIX_SUMS {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}}

/* Value rows 0-3 from r0 (v.row_bytes apart; 32 bytes each: two groups), two to a
   register: A rows 0 and `second` (1 or 2), B the other two in order.  Rows of two
   groups side by side (MH_I4_ADJACENT) come a pair a load, rows 0 and 1 in A and
   2 and 3 in B, whatever `second`. */
MH_INLINE void FN(i4_value_rows)(FN(kv_rows) v, const char *r0, int second, __m512i *A,
                                 __m512i *B)
{
    if (MH_I4_ADJACENT(v)) {
        *A = _mm512_loadu_si512((const void *)r0);
        *B = _mm512_loadu_si512((const void *)(r0 + 64));
        return;
    }
    const char *r1 = r0 + v.row_bytes, *r2 = r1 + v.row_bytes, *r3 = r2 + v.row_bytes;
    const char *a1 = second == 1 ? r1 : r2, *b0 = second == 1 ? r2 : r1;
    *A = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r0)),
                            _mm256_loadu_si256((const __m256i *)a1), 1);
    *B = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b0)),
                            _mm256_loadu_si256((const __m256i *)r3), 1);
}

/* o[0..4) (groups g0 and g0 + 1 in split order: g0's even channels, its odd
   ones, then g0 + 1's) += the mix of value rows [0, n16) with the weights *w
   (FN(i4_mix_weights)); rows of `pf` are prefetched along. */
static void FN(i4_mix_rows)(const FN(i4_mix_w) *w, FN(kv_rows) v, int64_t g0, int64_t n16,
                            __m512 *o, FN(kv_rows) pf)
{
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    MH_I4_MIX_ACCS;
    const char *base = v.base + g0 * (MH_I4_GROUP / 2);
    for (int64_t j = 0; j < n16; j += 4) {
        FN(prefetch_rows)(pf, j, 4);
        const char *r0 = base + j * v.row_bytes;
        /* rows 0 and 2 in A, 1 and 3 in B (each 16 bytes a group); rows of two groups
           side by side come rows 0 and 1 in A, 2 and 3 in B, and the lanes below
           hold rows 0, 2, 1, 3 */
        __m512i A, B;
        FN(i4_value_rows)(v, r0, 2, &A, &B);
        /* byte pairs of rows 0-1 (C) and 2-3 (E), 128-bit blocks: bytes 0-7, 16-23,
           8-15, 24-31 */
        const __m512i T1 = _mm512_unpacklo_epi8(A, B), T2 = _mm512_unpackhi_epi8(A, B);
        const __m512i C = _mm512_shuffle_i32x4(T1, T2, 0x44);
        const __m512i E = _mm512_shuffle_i32x4(T1, T2, 0xEE);
        /* a lane a byte of the four rows: W1's blocks bytes 0-3, 16-19, 8-11, 24-27,
           W2's 4-7, 20-23, 12-15, 28-31 (group 0, 1, 0, 1) */
        const __m512i W1 = _mm512_unpacklo_epi16(C, E), W2 = _mm512_unpackhi_epi16(C, E);
        const __m512i U0 = _mm512_and_si512(W1, low4),
                      U1 = _mm512_and_si512(_mm512_srli_epi16(W1, 4), low4),
                      U2 = _mm512_and_si512(W2, low4),
                      U3 = _mm512_and_si512(_mm512_srli_epi16(W2, 4), low4);
        __m512i D[3];
        for (int d = 0; d < 3; ++d) {
            int32_t x0, x1;
            memcpy(&x0, w->dig.planes[d][0] + j, 4);
            memcpy(&x1, w->dig.planes[d][1] + j, 4);
            D[d] = _mm512_mask_set1_epi32(_mm512_set1_epi32(x0), 0xF0F0, x1);
        }
        MH_I4_MIX_DOTS(D, U0, U1, U2, U3);
    }
    /* to split order: even channels (bytes' low nibbles) of group 0 from U0's
       and U2's blocks 0 and 2, of group 1 from blocks 1 and 3; odd from U1, U3 */
    const __m512i a[3][4] = MH_I4_MIX_SUMS;
    const __m512i idx0 =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    FN(i4_mix_finish)(w, a, idx0, _mm512_add_epi32(idx0, _mm512_set1_epi32(4)), o);
}

/* FN(i4_mix_rows) with the weights of FN(i4_mix_weights_vbmi), by byte permutes. */
MH_TARGET_VBMI static void FN(i4_mix_rows_vbmi)(const FN(i4_mix_w) *w, FN(kv_rows) v,
                                                int64_t g0, int64_t n16, __m512 *o,
                                                FN(kv_rows) pf)
{
    /* from rows 0, 1 (A) and 2, 3 (B): lane l of X[h] byte i is row i's byte
       8h + l / 2 of group l % 2 (each row's two groups 16 bytes apart) */
    static const uint8_t take[2][64] = {
        {0,  32, 64, 96,  16, 48, 80, 112, 1,  33, 65, 97,  17, 49, 81, 113,
         2,  34, 66, 98,  18, 50, 82, 114, 3,  35, 67, 99,  19, 51, 83, 115,
         4,  36, 68, 100, 20, 52, 84, 116, 5,  37, 69, 101, 21, 53, 85, 117,
         6,  38, 70, 102, 22, 54, 86, 118, 7,  39, 71, 103, 23, 55, 87, 119},
        {8,  40, 72, 104, 24, 56, 88, 120, 9,  41, 73, 105, 25, 57, 89, 121,
         10, 42, 74, 106, 26, 58, 90, 122, 11, 43, 75, 107, 27, 59, 91, 123,
         12, 44, 76, 108, 28, 60, 92, 124, 13, 45, 77, 109, 29, 61, 93, 125,
         14, 46, 78, 110, 30, 62, 94, 126, 15, 47, 79, 111, 31, 63, 95, 127}};
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i t0 = _mm512_loadu_si512((const void *)take[0]);
    const __m512i t1 = _mm512_loadu_si512((const void *)take[1]);
    MH_I4_MIX_ACCS;
    const char *base = v.base + g0 * (MH_I4_GROUP / 2);
    for (int64_t j = 0; j < n16; j += 4) {
        FN(prefetch_rows)(pf, j, 4);
        const char *r0 = base + j * v.row_bytes;
        __m512i A, B;
        FN(i4_value_rows)(v, r0, 1, &A, &B);
        const __m512i X0 = _mm512_permutex2var_epi8(A, t0, B);
        const __m512i X1 = _mm512_permutex2var_epi8(A, t1, B);
        const __m512i U0 = _mm512_and_si512(X0, low4),
                      U1 = _mm512_and_si512(_mm512_srli_epi16(X0, 4), low4),
                      U2 = _mm512_and_si512(X1, low4),
                      U3 = _mm512_and_si512(_mm512_srli_epi16(X1, 4), low4);
        __m512i D[3];
        for (int d = 0; d < 3; ++d) {
            int64_t x;
            memcpy(&x, w->dig.quads[j / 4] + 8 * d, 8);
            D[d] = _mm512_set1_epi64(x); /* (group 0's four rows in even lanes) */
        }
        MH_I4_MIX_DOTS(D, U0, U1, U2, U3);
    }
    /* to split order: group 0's even channels from U0's even lanes (bytes 0-7) and
       U2's (bytes 8-15), group 1's from the odd lanes; odd channels from U1, U3 */
    const __m512i a[3][4] = MH_I4_MIX_SUMS;
    const __m512i idx0 =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    FN(i4_mix_finish)(w, a, idx0, _mm512_add_epi32(idx0, _mm512_set1_epi32(1)), o);
}

/* o[0 .. 4 pairs) (pairs of groups from g0 on, FN(i4_mix_rows)'s order) += the mix of
   value rows [0, n16) with one query row's weights p, by integer dot products; 0,
   with o as it was, when a pair's weights cannot be written as digits. */
MH_INLINE int FN(i4_mix_dots)(const T *p, FN(kv_rows) v, int64_t g0, int64_t n16, int pairs,
                              __m512 *o, FN(kv_rows) pf)
{
    FN(i4_mix_w) mw[NVO]; /* (pairs <= NVO: a chunk takes at most 4 NVO vectors) */
    for (int gp = 0; gp < pairs; ++gp)
        if (!(v.permutes ? FN(i4_mix_weights_vbmi)(p, v, g0 + 2 * gp, n16, &mw[gp])
                         : FN(i4_mix_weights)(p, v, g0 + 2 * gp, n16, &mw[gp])))
            return 0;
    for (int gp = 0; gp < pairs; ++gp, pf = FN(no_rows)) {
        if (v.permutes)
            FN(i4_mix_rows_vbmi)(&mw[gp], v, g0 + 2 * gp, n16, o + 4 * gp, pf);
        else
            FN(i4_mix_rows)(&mw[gp], v, g0 + 2 * gp, n16, o + 4 * gp, pf);
    }
    return 1;
}
