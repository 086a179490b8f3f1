/*
 * The tile path (mh_instance.h): a block of up to MH_BLOCK_Q query rows,
 * transposed so that a tile of scores is key-major (st[j][i]) and the softmax
 * reductions run down the keys with one vector op per key for VW query rows
 * at once.  Per key block: scores with every mask applied, online softmax,
 * value mix, each in register tiles.  With the plan's MH_PATH_PAIRS the
 * scores and the mix take bfloat16 pair products (mh_pair_bf16.h) in the
 * marked places.
 */

/* Score tile: st[r][c*VW ..] = k_r . qt[., c*VW ..] for R keys (R <= JR) and NV
   query vectors (NV <= NVQ); JR x NVQ accumulators stay in registers while d
   runs over the head dimension, four steps at a time. */
#define MH_SCORE_STEP(dd)                                                          \
    do {                                                                           \
        V qv_[NVQ];                                                                \
        for (int c_ = 0; c_ < NV; ++c_) qv_[c_] = V_LOAD(qt + (dd) * BQ + c_ * VW); \
        for (int r_ = 0; r_ < R; ++r_) {                                           \
            const V kb_ = V_SET1(k[r_ * k_row + (dd)]);                            \
            for (int c_ = 0; c_ < NV; ++c_) acc[r_][c_] = V_FMA(kb_, qv_[c_], acc[r_][c_]); \
        }                                                                          \
    } while (0)

MH_INLINE void FN(score_tile)(const T *qt, int64_t E, const void *kp, int64_t k_row,
                              T *st, const int R, const int NV, const int DP, T scale)
{
#if MH_HAS_BF16_DOT
    if (DP) { /* qt: words [E/2][BQ]; kp: bfloat16 rows */
        FN(pair_score_tile)((const uint32_t *)qt, E, (const uint16_t *)kp, k_row, st, R, NV, scale);
        return;
    }
#else
    (void)DP;
    (void)scale;
#endif
    const T *k = (const T *)kp;
    V acc[JR][NVQ];
    int64_t d = 0;
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = V_ZERO();
    for (; d + 4 <= E; d += 4) {
        MH_SCORE_STEP(d);
        MH_SCORE_STEP(d + 1);
        MH_SCORE_STEP(d + 2);
        MH_SCORE_STEP(d + 3);
    }
    for (; d < E; ++d) MH_SCORE_STEP(d);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(st + r * BQ + c * VW, acc[r][c]);
}
#undef MH_SCORE_STEP

/* Keys [0, nkc) against NV query vectors: whole JR-key tiles, then one tile
   of the keys left over.  k: the key rows (bfloat16 with DP, else T). */
MH_INLINE void FN(score_keys)(const T *qt, int64_t E, const void *k, int64_t k_row, int64_t nkc,
                              T *st, const int NV, const int DP, T scale)
{
    const int64_t row_bytes = k_row * (DP ? 2 : (int64_t)sizeof(T));
    const char *kb = (const char *)k;
    int64_t j = 0;
    for (; j + JR <= nkc; j += JR)
        FN(score_tile)(qt, E, kb + j * row_bytes, k_row, st + j * BQ, JR, NV, DP, scale);
    kb += j * row_bytes;
    st += j * BQ;
    switch (nkc - j) { /* 0 .. JR-1 keys left; the guards keep R <= JR at compile time */
#define MH_REST(n) \
    case n: if (n < JR) FN(score_tile)(qt, E, kb, k_row, st, n < JR ? n : JR, NV, DP, scale); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* st[j][i] = (s q_i) . k_j (s: mh_score_scale) for j < nk keys and the first
   nvq query vectors: s is already in qt, or, with DP, qt holds unscaled words,
   k is bfloat16 and the scores are multiplied by `scale`.  On a tile that
   crosses the causal diagonal, each group of query vectors only computes the
   keys some of its rows can see (mh_keys_needed); the entries it skips are
   masked to -inf afterwards like their neighbours. */
MH_INLINE void FN(tile_scores)(const T *qt, int64_t E, const void *k, int64_t k_row,
                                  int64_t nk, int64_t nvq, int64_t row0_visible, T *st,
                                  const int DP, T scale)
{
    int64_t c = 0;
    for (; c + NVQ <= nvq; c += NVQ)
        FN(score_keys)(qt + c * VW, E, k, k_row, mh_keys_needed(row0_visible, (c + NVQ) * VW, nk),
                       st + c * VW, NVQ, DP, scale);
    switch (nvq - c) { /* 0 .. NVQ-1 query vectors left */
#define MH_REST(n) case n: if (n < NVQ) FN(score_keys)(qt + c * VW, E, k, k_row, \
        mh_keys_needed(row0_visible, (c + n) * VW, nk), st + c * VW, n < NVQ ? n : NVQ, DP, \
        scale); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* Keys and values [from, to) of pair `pair` widened into this thread's area
   (w->wid: keys [kv_len][E], values [kv_len][evp] zero padded). */
static void FN(widen_range)(const mh_attn_args *a, int64_t pair, int64_t from, int64_t to,
                            FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, evp = w->evp;
    FN(load_rows)(a, &a->k, &a->k_scale, pair, from, to - from, E, w->kwid + from * E, E);
    FN(load_rows)(a, &a->v, &a->v_scale, pair, from, to - from, Ev, w->vwid + from * evp, evp);
    for (int64_t j = from; j < to; ++j)
        for (int64_t d = Ev; d < evp; ++d) w->vwid[j * evp + d] = 0;
}

/* Rows [k0, k0 + nk) of pair `pair` widened in this thread's area: the header
   holds the pair and the rows [lo, hi) already there, which grow to cover
   each block the pair's next query blocks on this thread ask for, so no row
   is widened twice (and, with a window, rows no block sees are not). */
static void FN(widen_block)(const mh_attn_args *a, int64_t pair, int64_t k0, int64_t nk,
                            FN(work) *w)
{
    int64_t *hdr = w->wid; /* pair, lo, hi */
    if (hdr[0] != pair || hdr[1] >= hdr[2]) {
        hdr[0] = pair;
        hdr[1] = hdr[2] = k0;
    }
    if (k0 < hdr[1]) {
        FN(widen_range)(a, pair, k0, hdr[1], w);
        hdr[1] = k0;
    }
    if (k0 + nk > hdr[2]) {
        FN(widen_range)(a, pair, hdr[2], k0 + nk, w);
        hdr[2] = k0 + nk;
    }
}

/* Step 1: scaled scores of keys [k0, k0+nk) for the item's rows (and the
   vector padding lanes after them), every mask applied (-inf = hidden).
   Reads the key block as the plan says: in place, from the thread's widened
   rows, or copied into kpack first.  Returns 1 if the user mask may have
   hidden an entry. */
static int FN(tile_masked_scores)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                                  int64_t nvq, int64_t k0, int64_t nk, FN(work) *w)
{
    const int64_t E = a->head_dim;
#if MH_HAS_BF16_DOT
    if (w->dp) {
        int64_t k_row;
        const uint16_t *kh = FN(pair_keys)(a, pair, k0, nk, w, &k_row);
        FN(tile_scores)(w->qt, E, kh, k_row, nk, nvq, mh_row0_visible(a, q0, k0, nk), w->st, 1,
                        (T)mh_score_scale(a));
    } else
#endif
    {
        const T *k = w->kpack;
        int64_t k_row = E;
        if (w->k_in_place) {
            k = (const T *)a->k.base + a->k.off[pair] + k0 * a->k.row;
            k_row = a->k.row;
        } else if (w->wid) {
            FN(widen_block)(a, pair, k0, nk, w);
            k = w->kwid + k0 * E;
        } else {
            FN(load_rows)(a, &a->k, &a->k_scale, pair, k0, nk, E, w->kpack, E);
        }
        FN(tile_scores)(w->qt, E, k, k_row, nk, nvq, mh_row0_visible(a, q0, k0, nk), w->st, 0,
                        (T)1);
    }
    if (a->softcap > 0 || a->alibi.base) FN(transform_scores)(a, pair, q0, nq, nq, k0, nk, w->st, 1);
    /* only blocks that cross the diagonal or the window edge need element
       masking; padding lanes are masked too so every entry is defined */
    if (mh_block_is_cut(a, q0, nq, k0, nk))
        FN(mask_causal_window)(a, q0, nvq * VW, k0, nk, w->st, 1, BQ);
    return FN(mask_user)(a, pair, q0, nq, k0, nk, w->st, 1, BQ);
}

/* Step 2: online softmax, vectorised across query rows: st becomes the
   unnormalised probabilities, alpha the rescale of the accumulator.  With
   `mark`, hidden entries (-inf) become -0.0 so the mix can skip them. */
static void FN(tile_softmax)(FN(work) *w, int64_t nvq, int64_t nk, int mark)
{
    for (int64_t c = 0; c < nvq; ++c) {
        T *s = w->st + c * VW;
        const V m_old = V_LOAD(w->row_max + c * VW);
        /* four running maxima and two running sums: short dependency chains */
        V mx[4] = {m_old, m_old, m_old, m_old}, sum[2] = {V_ZERO(), V_ZERO()};
        int64_t j = 0;
        for (; j + 4 <= nk; j += 4)
            for (int u = 0; u < 4; ++u) mx[u] = V_MAX(mx[u], V_LOAD(s + (j + u) * BQ));
        for (; j < nk; ++j) mx[0] = V_MAX(mx[0], V_LOAD(s + j * BQ));
        const V m_new = V_MAX(V_MAX(mx[0], mx[1]), V_MAX(mx[2], mx[3]));
        const V m_use = V_NEG_INF_TO_ZERO(m_new); /* rows with nothing visible yet */
        const V al = MH_EXP2(V_SUB(m_old, m_use));
        if (mark) {
            for (j = 0; j < nk; ++j) {
                const V sj = V_LOAD(s + j * BQ);
                const V p = FN(mark_hidden)(MH_EXP2(V_SUB(sj, m_use)), sj);
                V_STORE(s + j * BQ, p);
                sum[j & 1] = V_ADD(sum[j & 1], p);
            }
        } else {
            for (j = 0; j + 2 <= nk; j += 2)
                for (int u = 0; u < 2; ++u) {
                    const V p = MH_EXP2(V_SUB(V_LOAD(s + (j + u) * BQ), m_use));
                    V_STORE(s + (j + u) * BQ, p);
                    sum[u] = V_ADD(sum[u], p);
                }
            if (j < nk) {
                const V p = MH_EXP2(V_SUB(V_LOAD(s + j * BQ), m_use));
                V_STORE(s + j * BQ, p);
                sum[0] = V_ADD(sum[0], p);
            }
        }
        V_STORE(w->row_sum + c * VW,
                V_FMA(V_LOAD(w->row_sum + c * VW), al, V_ADD(sum[0], sum[1])));
        V_STORE(w->row_max + c * VW, m_new);
        V_STORE(w->alpha + c * VW, al);
    }
}

/* Value vector c of key jj: from T rows, or (DP) from its half of the pair word. */
#if MH_HAS_BF16_DOT
#define MH_VALUE(jj, c) \
    (DP ? FN(pair_value)((const uint32_t *)v, v_row, (jj), (c)) : V_LOAD(v + (jj) * v_row + (c) * VW))
#else
#define MH_VALUE(jj, c) V_LOAD(v + (jj) * v_row + (c) * VW)
#endif

/* One key of the output tile: o[r][c] += p[j][r] * v[j][c]; with `select`,
   entries marked hidden (p == -0.0) are skipped rather than multiplied. */
#define MH_MIX_KEY(jj, select)                                                       \
    do {                                                                             \
        V vv_[NVO];                                                                  \
        for (int c_ = 0; c_ < NV; ++c_) vv_[c_] = MH_VALUE(jj, c_);                   \
        for (int r_ = 0; r_ < R; ++r_) {                                             \
            const T ps_ = pt[(jj) * BQ + r_];                                         \
            const V p_ = V_SET1(ps_);                                                \
            for (int c_ = 0; c_ < NV; ++c_)                                          \
                o[r_][c_] = (select) ? FN(fma_visible)(ps_, p_, vv_[c_], o[r_][c_])  \
                                     : V_FMA(p_, vv_[c_], o[r_][c_]);                \
        }                                                                            \
    } while (0)

/* acc[r] = alpha[r]*acc[r] + sum_j p[j][r] * v[j] for R rows (R <= IR) and NV
   value vectors (NV <= NVO): keys [j1, j2) are visible to every row; keys
   [j0, j1) and [j2, j3) only to some, so they go through the select.  The
   rescale is skipped when no row's running max moved (alpha == 1).  With DP,
   v holds pair words (v_row words per pair of keys) and the keys of [j1, j2)
   go in pairs with the probability words pw. */
MH_INLINE void FN(output_tile)(T *acc, int64_t evp, const T *alpha, const T *pt,
                               const uint32_t *pw, const T *v, int64_t v_row, int64_t j0,
                               int64_t j1, int64_t j2, int64_t j3, const int R, const int NV,
                               const int DP)
{
    V o[IR][NVO];
    int moved = 0;
    for (int r = 0; r < R; ++r) moved |= alpha[r] != (T)1;
    if (moved) {
        for (int r = 0; r < R; ++r) {
            const V a = V_SET1(alpha[r]);
            for (int c = 0; c < NV; ++c) o[r][c] = V_MUL(V_LOAD(acc + r * evp + c * VW), a);
        }
    } else {
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < NV; ++c) o[r][c] = V_LOAD(acc + r * evp + c * VW);
    }
    int64_t j = j0;
    for (; j < j1; ++j) MH_MIX_KEY(j, 1);
#if MH_HAS_BF16_DOT
    if (DP) { /* keys visible to every row in pairs (mh_pair_bf16.h) */
        if ((j & 1) && j < j2) {
            MH_MIX_KEY(j, 0);
            ++j;
        }
        for (; j + 2 <= j2; j += 2) MH_MIX_PAIR(j >> 1);
    }
#else
    (void)pw;
    (void)DP;
#endif
    for (; j < j2; ++j) MH_MIX_KEY(j, 0);
    for (; j < j3; ++j) MH_MIX_KEY(j, 1);
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) V_STORE(acc + r * evp + c * VW, o[r][c]);
}
#undef MH_MIX_KEY
#undef MH_VALUE

/* Output tiles of rows [0, nq) for NV value vectors starting at column vector c. */
MH_INLINE void FN(mix_rows)(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t k0, int64_t nk,
                            int cut, int user_hid, const T *v, int64_t v_row, int64_t c,
                            FN(work) *w, const int NV, const int DP)
{
    const int64_t evp = w->evp;
    int64_t i = 0, j[4] = {0, 0, 0, 0}; /* (unread when no row is left) */
    /* (DP: v holds 32-bit words, as many per pair of keys as T per key otherwise) */
    v += c * VW;
    for (; i + IR <= nq; i += IR) {
        mh_tile_key_ranges(a, q0, i, IR, k0, nk, cut, user_hid, j);
        FN(output_tile)(w->acc + i * evp + c * VW, evp, w->alpha + i, w->st + i, w->pt2 + i, v,
                        v_row, j[0], j[1], j[2], j[3], IR, NV, DP);
    }
    if (i < nq) mh_tile_key_ranges(a, q0, i, nq - i, k0, nk, cut, user_hid, j);
    switch (nq - i) { /* 0 .. IR-1 rows left */
#define MH_REST(n)                                                                              \
    case n: if (n < IR) FN(output_tile)(w->acc + i * evp + c * VW, evp, w->alpha + i, w->st + i, \
                                        w->pt2 + i, v, v_row, j[0], j[1], j[2], j[3],            \
                                        n < IR ? n : IR, NV, DP); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* The value vectors of the block, NVO at a time, for every row tile. */
MH_INLINE void FN(mix_columns)(const mh_attn_args *a, int64_t q0, int64_t nq, int64_t k0,
                               int64_t nk, int cut, int user_hid, const T *v, int64_t v_row,
                               FN(work) *w, const int DP)
{
    const int64_t nvv = (a->v_dim + VW - 1) / VW;
    int64_t c = 0;
    for (; c + NVO <= nvv; c += NVO)
        FN(mix_rows)(a, q0, nq, k0, nk, cut, user_hid, v, v_row, c, w, NVO, DP);
    switch (nvv - c) { /* 0 .. NVO-1 value vectors left */
#define MH_REST(n)                                                                         \
    case n: if (n < NVO) FN(mix_rows)(a, q0, nq, k0, nk, cut, user_hid, v, v_row, c, w, \
                                      n < NVO ? n : NVO, DP); break;
    MH_REST(1) MH_REST(2) MH_REST(3) MH_REST(4) MH_REST(5) MH_REST(6) MH_REST(7)
#undef MH_REST
    default: break;
    }
}

/* Step 3: acc[i][0 .. nvv*VW) = alpha[i]*acc[i] + P^T[:, i] . v for i < nq,
   the value block read in place or copied into vpack first (DP: interleaved
   into pair words in vpack, and the probabilities into pt2); each row tile
   stops at the last key its rows can see. */
static void FN(tile_mix)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                         int64_t k0, int64_t nk, int cut, int user_hid, FN(work) *w)
{
#if MH_HAS_BF16_DOT
    if (w->dp) {
        const uint32_t *vw = FN(pair_pack)(a, pair, nq, k0, nk, w);
        FN(mix_columns)(a, q0, nq, k0, nk, cut, user_hid, (const T *)vw, w->evp, w, 1);
        return;
    }
#endif
    const T *v = w->vpack;
    int64_t v_row = w->evp;
    if (w->v_in_place) {
        v = (const T *)a->v.base + a->v.off[pair] + k0 * a->v.row;
        v_row = a->v.row;
    } else if (w->wid) { /* (widened with the keys of this block) */
        v = w->vwid + k0 * w->evp;
    } else {
        FN(load_rows)(a, &a->v, &a->v_scale, pair, k0, nk, a->v_dim, w->vpack, w->evp);
    }
    FN(mix_columns)(a, q0, nq, k0, nk, cut, user_hid, v, v_row, w, 0);
}

/* qt[d][i] = scale * q[i][d] for rows i < nq; 0 in the padding lanes up to
   nvq * VW.  Whole VW x VW blocks go through the path's vector transpose. */
static void FN(load_qt)(const T *q, int64_t q_row, int64_t nq, int64_t nvq, int64_t E, T scale,
                        T *qt)
{
    int64_t d0 = 0;
#if MH_HAS_TRANSPOSE
    const V vs = V_SET1(scale);
    for (; d0 + VW <= E; d0 += VW)
        for (int64_t i0 = 0; i0 < nvq * VW; i0 += VW) {
            V r[VW];
            for (int l = 0; l < VW; ++l)
                r[l] = i0 + l < nq ? V_MUL(V_LOAD(q + (i0 + l) * q_row + d0), vs) : V_ZERO();
            V_TRANSPOSE(r);
            for (int l = 0; l < VW; ++l) V_STORE(qt + (d0 + l) * BQ + i0, r[l]);
        }
#endif
    for (int64_t d = d0; d < E; ++d) {
        for (int64_t i = 0; i < nq; ++i) qt[d * BQ + i] = q[i * q_row + d] * scale;
        for (int64_t i = nq; i < nvq * VW; ++i) qt[d * BQ + i] = 0;
    }
}

/* Tile path over keys [k_lo, k_hi): leaves the unnormalised output in w->acc
   and the running max and sum in w->row_max, w->row_sum. */
static void FN(attend_tile)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                            int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    const int64_t E = a->head_dim, Ev = a->v_dim, evp = w->evp;
    const int64_t nvq = (nq + VW - 1) / VW, nvv = (Ev + VW - 1) / VW;
    const int64_t q_start = a->q.off[pair] + q0 * a->q.row;

#if MH_HAS_BF16_DOT
    if (w->dp)
        FN(pair_load_queries)((const uint16_t *)a->q.base + q_start, a->q.row, nq, nvq, E,
                              (uint32_t *)w->qt);
    else
#endif
    {
        const T *q = (const T *)a->q.base + q_start;
        int64_t q_row = a->q.row;
        if (a->q_format != MH_NATIVE) { /* widened into kpack, free until the first key block */
            for (int64_t i = 0; i < nq; ++i)
                FN(half_or_bf16_row)(a->q_format, w->kpack + i * w->ep,
                                     (const uint16_t *)a->q.base + q_start + i * a->q.row, E);
            q = w->kpack;
            q_row = w->ep;
        }
        FN(load_qt)(q, q_row, nq, nvq, E, (T)mh_score_scale(a), w->qt);
    }
    for (int64_t i = 0; i < BQ; ++i) {
        w->row_max[i] = (T)(-INFINITY);
        w->row_sum[i] = 0;
    }
    for (int64_t i = 0; i < nq * evp; i += VW) V_STORE(w->acc + i, V_ZERO());
    /* the last value vector reads padding columns: keep them 0 */
    if (!w->v_in_place && nvv * VW > Ev)
        for (int64_t i = 0; i < BK * evp; ++i) w->vpack[i] = 0;

    int64_t k_begin, k_end;
    mh_key_range(a, q0, nq, k_lo, k_hi, &k_begin, &k_end);
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        const int cut = mh_block_is_cut(a, q0, nq, k0, nk);
        const int user_hid = FN(tile_masked_scores)(a, pair, q0, nq, nvq, k0, nk, w);
        FN(tile_softmax)(w, nvq, nk, cut || user_hid);
        if (a->dropout_p > 0) FN(apply_dropout)(a, pair, q0, nq, k0, nk, w->st, 1, BQ);
        FN(tile_mix)(a, pair, q0, nq, k0, nk, cut, user_hid, w);
    }
}

