static void FN(attend)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                       int64_t k_lo, int64_t k_hi, FN(work) *w)
{
    if (w->few_rows)
        FN(attend_few_rows)(a, pair, q0, nq, k_lo, k_hi, w);
    else
        FN(attend_tile)(a, pair, q0, nq, k_lo, k_hi, w);
}

/* ---- entry points (mh_kernel_table) ----------------------------------------- */

/* Second sweep for the dense weights: recompute each tile, normalise with the
   final row max and sum (w->row_sum holds 1/sum), write rows [q0, q0+nq). */
static void FN(write_weights)(const mh_attn_args *a, int64_t pair, int64_t q0, int64_t nq,
                              FN(work) *w)
{
    const int64_t S = a->kv_len, nvq = (nq + VW - 1) / VW;
    T *wt = (T *)a->weights + (pair * a->q_len + q0) * S;
    int64_t k_begin, k_end;
    mh_key_range(a, q0, nq, 0, S, &k_begin, &k_end);
    for (int64_t i = nq; i < nvq * VW; ++i) w->row_max[i] = 0;
    for (int64_t k0 = k_begin; k0 < k_end; k0 += BK) {
        const int64_t nk = (k_end - k0 < BK) ? k_end - k0 : BK;
        FN(tile_masked_scores)(a, pair, q0, nq, nvq, k0, nk, w);
        for (int64_t c = 0; c < nvq; ++c) {
            V m_use = V_NEG_INF_TO_ZERO(V_LOAD(w->row_max + c * VW));
            V inv = V_LOAD(w->row_sum + c * VW);
            for (int64_t j = 0; j < nk; ++j) {
                T *s = w->st + j * BQ + c * VW;
                V_STORE(s, V_MUL(MH_EXP2(V_SUB(V_LOAD(s), m_use)), inv));
            }
        }
        if (a->dropout_p > 0) FN(apply_dropout)(a, pair, q0, nq, k0, nk, w->st, 1, BQ);
        for (int64_t i = 0; i < nq; ++i)
            for (int64_t j = 0; j < nk; ++j) wt[i * S + k0 + j] = w->st[j * BQ + i];
    }
}

/* o[0..n) = acc[0..n) * inv in the output's storage: T, or float16 or bfloat16
   bits (a->out_format, float kernels). */
static inline void FN(store_out)(const mh_attn_args *a, int64_t offset, const T *acc, T inv,
                                 int64_t n)
{
    const V vinv = V_SET1(inv);
    int64_t d = 0;
    if (a->out_format != MH_NATIVE) { /* MH_STORE_F16 or MH_STORE_BF16 */
        const int bf16 = a->out_format == MH_STORE_BF16;
        uint16_t *o = (uint16_t *)a->out.base + offset;
#if MH_HAS_HALF_STORE
        for (; d + VW <= n; d += VW) {
            const V x = V_MUL(V_LOAD(acc + d), vinv);
            if (bf16)
                V_STORE_BF16(o + d, x);
            else
                V_STORE_HALF(o + d, x);
        }
#endif
        for (; d < n; ++d) {
            const float x = (float)(acc[d] * inv);
            o[d] = bf16 ? mh_float_to_bf16(x) : mh_float_to_half(x);
        }
        return;
    }
    T *o = (T *)a->out.base + offset;
    for (; d + VW <= n; d += VW) V_STORE(o + d, V_MUL(V_LOAD(acc + d), vinv));
    for (; d < n; ++d) o[d] = acc[d] * inv;
}

/* mh_block_fn: rows [q0, q0 + BQ) of pair `pair` against every key (with
   grouped query heads: all G * L rows of the kv pair, q0 = 0). */
void FN(mh_block_item)(const mh_attn_args *a, int64_t pair, int64_t q0, void *scratch)
{
    const int64_t Ev = a->v_dim, S = a->kv_len, G = mh_group(a);
    const int64_t nq = G > 1 ? G * a->q_len : ((a->q_len - q0 < BQ) ? a->q_len - q0 : BQ);
    /* the plan of a pair's last query block, which may be short, is item[1] */
    FN(work) w = FN(carve)(a, &a->plan->item[q0 + BQ >= a->q_len], scratch);

    FN(attend)(a, pair, q0, nq, 0, S, &w);

    /* normalise once; rows that saw no key (and have no sink) give zeros */
    for (int64_t i = 0; i < nq; ++i) {
        const T inv = FN(row_finish)(a, pair, q0, i, nq / G, w.row_max[i], w.row_sum[i]);
        w.row_sum[i] = inv;
        FN(store_out)(a, mh_row_offset(a, &a->out, pair, q0, i, nq / G), w.acc + i * w.evp, inv,
                      Ev);
    }
    if (a->weights) FN(write_weights)(a, pair, q0, nq, &w);
}

/* mh_split_fn: every query row (q_len <= MH_BLOCK_Q) of pair `pair` against
   each key range [r * split_keys, (r + 1) * split_keys) of the item's run of
   split_run ranges, in turn; writes each range's unnormalised output, row max
   and row sum to the partial buffers for mh_merge_item.  A range's result
   does not depend on the run it is in: its rows start from no key seen (the
   few-rows path prepares the query rows once for the run). */
void FN(mh_split_item)(const mh_attn_args *a, int64_t pair, int64_t item, void *scratch)
{
    const mh_plan *p = a->plan;
    const int64_t L = a->q_len * mh_group(a), Ev = a->v_dim, keys = p->split_keys;
    const int64_t r0 = item * p->split_run;
    const int64_t r1 = r0 + p->split_run < p->n_split ? r0 + p->split_run : p->n_split;
    FN(work) w = FN(carve)(a, &p->item[0], scratch);
    if (w.few_rows) FN(few_rows_prep)(a, pair, 0, L, &w);
    for (int64_t range = r0; range < r1; ++range) {
        const int64_t part = pair * p->n_split + range;
        T *pacc = (T *)a->split.acc + part * L * Ev;
        T *pm = (T *)a->split.row_max + part * L;
        T *pl = (T *)a->split.row_sum + part * L;
        if (w.few_rows) {
            FN(few_rows_reset)(&w, L);
            FN(few_rows_blocks)(a, pair, 0, L, range * keys, (range + 1) * keys, &w);
        } else {
            FN(attend)(a, pair, 0, L, range * keys, (range + 1) * keys, &w);
        }
        for (int64_t i = 0; i < L; ++i) {
            pm[i] = w.row_max[i];
            pl[i] = w.row_sum[i];
            for (int64_t d = 0; d < Ev; ++d) pacc[i * Ev + d] = w.acc[i * w.evp + d];
        }
    }
}

/* mh_merge_fn: the n_split partial results of pair `pair` merged in range
   order (so the result does not depend on which thread computed which range)
   into the output. */
void FN(mh_merge_item)(const mh_attn_args *a, int64_t pair, void *scratch)
{
    const int64_t L = a->q_len * mh_group(a), Ev = a->v_dim, ns = a->plan->n_split;
    const T *pacc = (const T *)a->split.acc + pair * ns * L * Ev;
    const T *pm = (const T *)a->split.row_max + pair * ns * L;
    const T *pl = (const T *)a->split.row_sum + pair * ns * L;
    T *acc = (T *)scratch;
    for (int64_t i = 0; i < L; ++i) {
        T m = (T)(-INFINITY);
        int has_nan = 0;
        for (int64_t s = 0; s < ns; ++s) {
            const T ms = pm[s * L + i];
            if (ms != ms) has_nan = 1;
            else if (ms > m) m = ms;
        }
        const T m_use = (m == (T)(-INFINITY)) ? (T)0 : m;
        T sum = has_nan ? (T)NAN : (T)0;
        for (int64_t d = 0; d < Ev; ++d) acc[d] = 0;
        for (int64_t s = 0; s < ns; ++s) {
            const T f = (T)exp2((double)(pm[s * L + i] - m_use));
            sum += pl[s * L + i] * f;
            for (int64_t d = 0; d < Ev; ++d) acc[d] += pacc[(s * L + i) * Ev + d] * f;
        }
        FN(store_out)(a, mh_row_offset(a, &a->out, pair, 0, i, a->q_len), acc,
                      FN(row_finish)(a, pair, 0, i, a->q_len, m, sum), Ev);
    }
}

/* What this instantiation can do, for the planner (mh_plan_attention). */
const mh_caps FN(mh_caps) = {VW, MH_IN_PLACE_FORMATS, MH_HAS_BF16_DOT, MH_HAS_I4_DOTS};
