/*
 * What a call may do to its scores besides masking them, and how a row ends
 * (mh_instance.h): the soft cap and the ALiBi bias on the scaled scores (both
 * paths, both score layouts), and each row's softmax denominator with its
 * sink and its log-sum-exp.  Scores are in log2 units here as everywhere
 * (mh_common.h): a cap c becomes c log2(e), a slope slope log2(e).
 */

#ifndef MH_SCORES_COMMON_DONE
#define MH_SCORES_COMMON_DONE
#define MH_LN2 0.69314718055994530942

/* The per-query-head value of row r (rows_per_head rows a head) at operand op. */
static inline double mh_head_value(const mh_attn_args *a, const mh_operand *op, int64_t pair,
                                   int64_t r, int64_t rows_per_head, int f64)
{
    const int64_t at = op->off[pair * mh_group(a) + r / rows_per_head];
    return f64 ? ((const double *)op->base)[at] : ((const float *)op->base)[at];
}
#endif

/* tanh(x) per lane, to a few units of T's epsilon relative to it; NaN stays NaN.
   Near 0 (|x| below 0.5 in float, 0.15 in double) its series to x^15, whose next
   term is below T's epsilon there; elsewhere 2 / (1 + e^(-2x)) - 1, exact at the
   ends (+-1) and within several epsilon of tanh from those thresholds on.  (That
   formula alone kept only an absolute precision near 0: a cap c far above the
   scores changed each by about c epsilon, and from about 1e8 made every float32
   score 0.)  The clamp keeps e^(-2x) finite where tanh is -1. */
MH_INLINE V FN(tanh)(V x)
{
    const V lo = V_SET1((T)(sizeof(T) == sizeof(float) ? -40 : -300));
    const V e = V_EXP(V_MUL(V_SET1((T)-2), V_MAX(lo, x))); /* V_MAX(lo, NaN) is NaN */
    const V far = V_SUB(V_DIV(V_SET1((T)2), V_ADD(V_SET1((T)1), e)), V_SET1((T)1));
    /* x + x z (c3 + z (c5 + ... + z c15)), z = x^2: tanh's Taylor coefficients */
    static const double c[7] = {-929569.0 / 638512875.0, 21844.0 / 6081075.0,
                                -1382.0 / 155925.0,      62.0 / 2835.0,
                                -17.0 / 315.0,           2.0 / 15.0,
                                -1.0 / 3.0};
    const V z = V_MUL(x, x);
    V poly = V_SET1((T)c[0]);
    for (int i = 1; i < 7; ++i) poly = V_FMA(poly, z, V_SET1((T)c[i]));
    const V near = V_FMA(V_MUL(poly, z), x, x);
    const T small = (T)(sizeof(T) == sizeof(float) ? 0.5 : 0.15);
#if MH_HAS_SELECT
    return V_WHERE_SMALL(x, V_SET1(small), near, far);
#else
    T xl[VW], nl[VW], fl[VW];
    V_STORE(xl, x);
    V_STORE(nl, near);
    V_STORE(fl, far);
    for (int l = 0; l < VW; ++l)
        if (xl[l] < small && xl[l] > -small) fl[l] = nl[l];
    return V_LOAD(fl);
#endif
}

/* s = cap2 tanh(s / cap2) on `lines` lines of nvec vectors, `step` apart. */
static void FN(softcap_lines)(T *s, int64_t lines, int64_t step, int64_t nvec, T cap2)
{
    const V c = V_SET1(cap2), inv = V_SET1((T)1 / cap2);
    for (int64_t l = 0; l < lines; ++l)
        for (int64_t v = 0; v < nvec; ++v) {
            T *p = s + l * step + v * VW;
            V_STORE(p, V_MUL(c, FN(tanh)(V_MUL(V_LOAD(p), inv))));
        }
}

/* s[e] -= slope2 |d0 + dir e| for the nvec * VW entries e of one line. */
static void FN(alibi_line)(T *s, int64_t nvec, T d0, T dir, T slope2)
{
    T iota[VW];
    for (int l = 0; l < VW; ++l) iota[l] = (T)l * dir;
    const V neg = V_SET1(-slope2), step = V_SET1(dir * (T)VW);
    V d = V_ADD(V_SET1(d0), V_LOAD(iota));
    for (int64_t v = 0; v < nvec; ++v) {
        const V dist = V_MAX(d, V_SUB(V_ZERO(), d)); /* |d| */
        V_STORE(s + v * VW, V_FMA(neg, dist, V_LOAD(s + v * VW)));
        d = V_ADD(d, step);
    }
}

/* The soft cap and the ALiBi bias on scores of rows [q0, ...) and keys
   [k0, k0 + nk) of an item: key-major (tile path: one head, nvq vectors of
   rows per key) or row-major (few-rows path: `rows` rows, rows_per_head a
   head, the keys in whole vectors). */
static void FN(transform_scores)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t rows,
                                 int64_t rows_per_head, int64_t k0, int64_t nk, T *s,
                                 int key_major)
{
    const int64_t nvq = (rows + VW - 1) / VW, nvk = (nk + VW - 1) / VW;
    const T shift = (T)(q0 + a->kv_len - a->q_len - k0); /* row i, key j: i + shift - j */
    const int f64 = sizeof(T) == sizeof(double);
    if (a->softcap > 0) {
        const T cap2 = (T)(a->softcap * MH_LOG2E);
        if (key_major)
            FN(softcap_lines)(s, nk, BQ, nvq, cap2);
        else
            FN(softcap_lines)(s, rows, BK, nvk, cap2);
    }
    if (!a->alibi.base) return;
    if (key_major) {
        const T slope2 = (T)(mh_head_value(a, &a->alibi, pair, 0, rows_per_head, f64) * MH_LOG2E);
        for (int64_t j = 0; j < nk; ++j) FN(alibi_line)(s + j * BQ, nvq, shift - (T)j, 1, slope2);
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const T slope2 = (T)(mh_head_value(a, &a->alibi, pair, r, rows_per_head, f64) * MH_LOG2E);
        FN(alibi_line)(s + r * BK, nvk, shift + (T)(r % rows_per_head), -1, slope2);
    }
}

/* row_finish with a sink or a log-sum-exp to write (see there). */
static T FN(row_finish_sink_lse)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t r,
                                 int64_t rows_per_head, T m, T l)
{
    const double m_use = m == (T)(-INFINITY) ? 0.0 : (double)m;
    double top = m_use, d = l, f = 1; /* denominator d in units of 2^top; 1/l = f/d */
    if (a->sinks.base) {
        const double s2 = mh_head_value(a, &a->sinks, pair, r, rows_per_head,
                                        sizeof(T) == sizeof(double)) * MH_LOG2E;
        top = s2 > m_use ? s2 : m_use; /* (NaN: m_use, and d turns NaN below) */
        f = exp2(m_use - top);
        d = (double)l * f + exp2(s2 - top);
    }
    if (a->lse.base) {
        float *lse = (float *)a->lse.base + mh_row_offset(a, &a->lse, pair, q0, r, rows_per_head);
        *lse = d == 0 ? -INFINITY : (float)((top + log2(d)) * MH_LN2);
    }
    if (!a->sinks.base) return l == 0 ? (T)0 : (T)1 / l;
    return d == 0 ? (T)0 : (T)(f / d);
}

/* The reciprocal of row r's softmax denominator, given its running max m and
   sum l (l in units of 2^m; m -inf: nothing seen), the row's sink included;
   writes the row's log-sum-exp where asked.  Without a sink the reciprocal is
   1/l in T, as the paths have always computed it. */
MH_INLINE T FN(row_finish)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t r,
                           int64_t rows_per_head, T m, T l)
{
    if (!a->sinks.base && !a->lse.base) return l == 0 ? (T)0 : (T)1 / l;
    return FN(row_finish_sink_lse)(a, pair, q0, r, rows_per_head, m, l);
}
