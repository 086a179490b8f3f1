/*
 * Where the few-rows path finds a pair's stored key and value rows (read in
 * place), and how decode asks for them ahead of its reading (mh_few_rows.h).
 */

/* Where the keys (or values) of rows [k0, ...) of a pair are, in place. */
typedef struct {
    const char *base; int64_t row_bytes; /* row j at base + j * row_bytes */
    int64_t data_bytes; /* the bytes a row holds (<= row_bytes) */
    const char *scale; int64_t scale_bytes; /* int8 / int4: row j's scale(s) */
    int to_l2; /* FN(prefetch_rows) asks for these rows into L2 (else L1) */
    int with_scales; /* ... and for their scale rows, into L1 */
    int permutes; /* int4 values: mixed through byte permutes (plan->i4_permutes) */
} FN(kv_rows);

MH_INLINE FN(kv_rows) FN(kv_in_place)(const mh_attn_args *a, const mh_operand *src,
                                  const mh_operand *scale, int64_t pair, int64_t k0)
{
    const int64_t eb = mh_stored_bytes(a->kv_format);
    FN(kv_rows) r;
    const int64_t n = src == &a->k ? a->head_dim : a->v_dim;
    r.base = (const char *)src->base + (src->off[pair] + k0 * src->row) * eb;
    r.row_bytes = src->row * eb;
    r.data_bytes = a->kv_format == MH_STORE_I4 ? n / 2 : n * eb;
    r.scale = 0;
    r.scale_bytes = 0;
    /* (int4 near: see MH_AHEAD) */
    const int near = a->kv_format == MH_STORE_I4 && a->plan->prefetch_near;
    r.to_l2 = a->kv_format != MH_STORE_I8 && !near;
    r.with_scales = near;
    r.permutes = a->plan->i4_permutes;
    if (a->kv_format == MH_STORE_I8 || a->kv_format == MH_STORE_I4) {
        const int64_t sb = a->kv_format == MH_STORE_I8 ? 4 : 2; /* float32 / float16 */
        r.scale = (const char *)scale->base + (scale->off[pair] + k0 * scale->row) * sb;
        r.scale_bytes = scale->row * sb;
    }
    return r;
}


/* Decode streams two arrays, the keys while it takes the scores and then the
   values while it mixes them.  Each phase asks for the other array's rows at
   the pace it reads its own: the scores for the same block's values, the mix
   for the next block's keys.  So both streams stay in flight, and the hardware
   prefetchers do not start again from a cold page at every block.  Measured
   on one decode call (12 heads of 64, L=16384, 2 threads, caches evicted
   between calls): float32 -17%, int8 -17 to -26%, int4 -16%, float16 -10%;
   with the cache warm (L=2048, 1 thread) +4 to +8% for the added instructions.
   Shorter float32 calls gain least and lose most warm, so a float32 call whose
   keys and values take less than MH_PREFETCH_MIN_BYTES (they may well sit in the
   last-level cache) does not ask; the narrower formats, whose widening leaves
   time for the requests, ask at every length.  On an Intel Xeon with AMX (12
   heads of 64, 2 threads, medians of 11 rounds alternating in one process, 256
   MiB of calls cycled / one call repeated): L=128 float16 0.79x / 0.98x the
   time, int8 0.75x / 1.01x, int4 0.78x / 1.02x; L=512 0.74x / 1.11x (float16),
   0.71x / 1.0x (int8), 0.74x / 1.12x (int4); L=2048 0.69-0.75x / 0.78-1.04x;
   float32 L=256 0.92x / 1.24x, L=512 (3 MB) 0.92x / 1.10x, L=768 (4.7 MB)
   0.88x / 1.01x.  A fused layer's decode step over caches stepped in turn:
   L=1024 float32 0.92x, float16 and int8 0.82-0.87x, int4 0.92-0.93x; L=4096
   int8 0.78-0.80x, L=8192 int4 0.82-0.83x; one layer stepped warm within 5%.
   On an AMD EPYC with AVX-512 (Zen 4; the same A/B of builds in one process)
   this rule moved nothing by more than 2%, warm or cold: float16, int8 and
   int4 at L=128-2048 against asking from 4 MiB only, and float32 at 1.5-6 MiB
   asking always, from 4 MiB or from 16 MiB.  A whole block asked for at once
   was slower: its misses queue ahead of the loads the loop waits on.  Float
   rows (float32, float16, bfloat16) are asked for into L2: their reading is
   bound by the memory, and on an AMD EPYC with AVX-512 (12 heads
   of 64, 2 threads, L=16384, evicted, medians of 11-15 rounds alternating in
   one process) a float32 call took 1.18-1.23x less time than with the rows
   asked into L1 (1.43x at L=32768, 1.30x warm, 1.43x on one thread),
   float16 1.10-1.17x, bfloat16 1.06x.  int8 and int4 rows, whose reading
   takes more instructions a byte: int8 keeps L1 (into L2 it took 0.93-1.07x
   the time, and 1.16x in two runs of a later session).  int4 rows: the two
   vendors measured differ, so the plan chooses (prefetch_near).  On AMD they
   go into L2 and a block further ahead (MH_AHEAD): on an EPYC with caches
   stepped in turn (12 heads of 64, L=16384, 256 MiB of caches, medians of 9
   rounds alternating in one process) 0.91-0.97x the time on two threads
   (5 runs) and 0.92-1.0x on one (3 runs); into L2 alone 0.93-1.01x, further
   ahead into L1 1.02-1.06x.  Elsewhere ("near") they are asked for one phase
   ahead, as int8's, into L1, and their scale rows too: on an Intel Xeon with
   AMX (1 GiB of caches attended in turn, 2 threads, medians of 9 rounds
   alternating in one process) 0.88-0.89x the time of the AMD choice in two
   runs; without the scale rows 0.92x, with them into L2 0.90x, a block
   ahead into L1 0.95x, one phase ahead into L2 0.92-0.94x, 8 to 32 rows
   further 0.90-0.92x, and 128 to 1024 rows further into L2 as well 1.10-1.21x
   (int8's scale rows asked for too took 1.03-1.05x the time there).  For the
   other formats two blocks ahead instead of one was within noise, four or
   eight slower.  p.data_bytes 0: nothing. */
#define MH_AHEAD(a) ((a)->kv_format == MH_STORE_I4 && !(a)->plan->prefetch_near ? BK : 0)
static inline void FN(prefetch_rows)(FN(kv_rows) p, int64_t j, int64_t n)
{
    if (p.data_bytes && p.row_bytes == p.data_bytes && p.row_bytes < 64) {
        /* rows side by side, shorter than a line: each line once (int4 rows of 64
           channels take half a line: an int4 step with its cache in L3 1.03x less
           time on one thread) */
        const char *a = (const char *)((uintptr_t)(p.base + j * p.row_bytes) & ~(uintptr_t)63);
        const char *end = p.base + (j + n) * p.row_bytes;
        if (p.with_scales) {
            const char *s = p.scale + j * p.scale_bytes, *se = s + n * p.scale_bytes;
            for (s = (const char *)((uintptr_t)s & ~(uintptr_t)63); s < se; s += 64)
                MH_PREFETCH(s);
        }
        if (p.to_l2)
            for (; a < end; a += 64) MH_PREFETCH_L2(a);
        else
            for (; a < end; a += 64) MH_PREFETCH(a);
        return;
    }
    if (p.to_l2) {
        for (int64_t x = 0; x < p.data_bytes; x += 64)
            for (int64_t r = j; r < j + n; ++r) MH_PREFETCH_L2(p.base + r * p.row_bytes + x);
        return;
    }
    for (int64_t x = 0; x < p.data_bytes; x += 64) /* (one compare when there is nothing) */
        for (int64_t r = j; r < j + n; ++r) MH_PREFETCH(p.base + r * p.row_bytes + x);
}

static const FN(kv_rows) FN(no_rows) = {0, 0, 0, 0, 0, 0, 0, 0};

/* r from its row j on */
MH_INLINE FN(kv_rows) FN(kv_skip)(FN(kv_rows) r, int64_t j)
{
    if (r.base) r.base += j * r.row_bytes;
    if (r.scale) r.scale += j * r.scale_bytes;
    return r;
}
