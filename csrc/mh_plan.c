/*
 * The plan of one attention call (mh_kernels.h, "the plan of one call"):
 * every decision about what a call does is taken here, once, before any work
 * item runs: the schedule (query blocks, or key ranges then a merge), which
 * query heads are served together, the path and the reads of each kind of
 * item, the threads, the prefetching, the rows kept widened and the scratch.
 * The work items only follow it.  Compiled without ISA flags: what an ISA
 * can do comes in as its mh_caps.
 */
#include <string.h>
#include "mh_kernels.h"

/* Keys per range of the split schedule: fixed, so that a result never
   depends on the thread count. */
#define MH_SPLIT_KEYS 512
/* A split item takes up to MH_SPLIT_RUN consecutive ranges of its pair in
   turn, as long as each thread keeps about MH_SPLIT_ITEMS_PER_THREAD items to
   balance with.  Its thread then streams the pair's keys and values on from
   one range to the next, its read-ahead already there, and prepares the query
   rows once.  Decode over caches of 12 heads of 64, 2 threads, medians of
   rounds alternating in one process, against one range an item: L=16384,
   eight such layers stepped in turn (each finds its cache out of the
   last-level cache), int4 1.19x less time, int8 1.20x, float16 1.03x;
   L=4096 int4 1.30x, int8 1.15x; one layer at L=16384, int4 1.22x.  Runs of
   16 measured as 8.  A range's result is the same in any run. */
#define MH_SPLIT_RUN 8
#define MH_SPLIT_ITEMS_PER_THREAD 8
/* Multiply-adds below which a call runs on the calling thread alone: waking
   the pool costs more than the split saves ... */
#define MH_SERIAL_WORK 524288.0
/* ... and below which it does so while threads were recently found without a
   core (waiting for a descheduled thread costs more than such a call). */
#define MH_SERIAL_WORK_CONTENDED 8388608.0
/* Bytes all threads together may keep widened in a half-precision prefill. */
#define MH_WIDENED_BUDGET ((size_t)64 << 20)
/* The tile path reads a block's rows many times: in place only when they lie
   close together (a long row stride maps them onto few cache sets). */
#define MH_DIRECT_ROW_BYTES 1024

#define MH_ROUND16(n) (((n) + 15) / 16 * 16)

mh_scratch_layout mh_scratch_plan(int64_t head_dim, int64_t v_dim)
{
    mh_scratch_layout s;
    s.ep = MH_ROUND16(head_dim);
    s.evp = MH_ROUND16(v_dim);
    s.qt = 0;
    /* the tile path keeps the query block transposed (head_dim x BLOCK_Q), the few-rows
       path as up to BLOCK_Q rows of ep (grouped decode): room for the larger */
    s.st = s.qt + MH_BLOCK_Q * s.ep;
    s.acc = s.st + (int64_t)MH_BLOCK_K * MH_BLOCK_Q;
    s.kpack = s.acc + (int64_t)MH_BLOCK_Q * s.evp;
    s.vpack = s.kpack + (int64_t)MH_BLOCK_K * s.ep;
    s.row_max = s.vpack + (int64_t)MH_BLOCK_K * s.evp;
    s.row_sum = s.row_max + MH_BLOCK_Q;
    s.alpha = s.row_sum + MH_BLOCK_Q;
    s.pt2 = s.alpha + MH_BLOCK_Q;
    s.elems = s.pt2 + (int64_t)MH_BLOCK_K / 2 * MH_BLOCK_Q;
    return s;
}

size_t mh_scratch_stride(int64_t head_dim, int64_t v_dim, size_t elem_size)
{
    const size_t bytes = (size_t)mh_scratch_plan(head_dim, v_dim).elems * elem_size;
    return (bytes + MH_SCRATCH_ALIGN - 1) / MH_SCRATCH_ALIGN * MH_SCRATCH_ALIGN;
}

size_t mh_widened_bytes(int64_t head_dim, int64_t v_dim, int64_t rows)
{
    const size_t bytes = MH_SCRATCH_ALIGN +
                         (size_t)rows * (size_t)(head_dim + MH_ROUND16(v_dim)) * sizeof(float);
    return (bytes + MH_SCRATCH_ALIGN - 1) / MH_SCRATCH_ALIGN * MH_SCRATCH_ALIGN;
}

void mh_widened_reset(void *thread_scratch, int64_t head_dim, int64_t v_dim)
{
    int64_t *hdr = (int64_t *)((char *)thread_scratch +
                               mh_scratch_stride(head_dim, v_dim, sizeof(float)));
    hdr[0] = -1;          /* pair */
    hdr[1] = hdr[2] = 0;  /* rows [lo, hi) widened */
}

void *mh_scratch_align(void *raw)
{
    const uintptr_t p = (uintptr_t)raw;
    return (void *)((p + MH_SCRATCH_ALIGN - 1) / MH_SCRATCH_ALIGN * MH_SCRATCH_ALIGN);
}


/* Query heads one item serves together: decode with grouped-query attention
   reads each key and value once for the heads that share them, when nothing
   differs between those heads but their queries. */
static int64_t mh_plan_group(const mh_call_desc *d)
{
    const int64_t g = d->gqa;
    if (g < 2 || d->weights || d->dropout || d->mask_per_head) return 1;
    if (d->q_len > MH_FEW_ROWS || g * d->q_len > MH_BLOCK_Q) return 1;
    return g;
}

/* 1 for the split schedule: a few query rows against many keys (or asked for),
   without dense weights or dropout. */
static int mh_plan_split(const mh_call_desc *d)
{
    const int wanted = d->split < 0 ? d->q_len <= MH_FEW_ROWS && d->kv_len >= 2 * MH_SPLIT_KEYS
                                    : d->split > 0;
    return wanted && !d->weights && !d->dropout && d->q_len <= MH_BLOCK_Q;
}

/* The path and reads of an item of `rows` query rows (widened: the plan
   keeps half-precision rows widened per thread). */
static mh_item_plan mh_plan_item(const mh_call_desc *d, const mh_caps *caps, int64_t rows,
                                 int64_t group, int widened)
{
    const int native = d->kv_format == (d->elem_size == 8 ? MH_STORE_F64 : MH_STORE_F32);
    mh_item_plan ip;
    ip.rows = rows;
    if ((rows <= MH_FEW_ROWS || group > 1) && !d->weights) {
        /* in place: formats this ISA widens as it loads, rows of whole vectors
           (int4: at most MH_I4_MAX_GROUPS groups) */
        const int widens = (caps->in_place >> d->kv_format) & 1u;
        const int64_t i4_max = MH_I4_MAX_GROUPS * MH_I4_GROUP;
        const int i4 = d->kv_format == MH_STORE_I4;
        ip.path = MH_PATH_FEW_ROWS;
        ip.k_read = widens && d->head_dim % caps->lanes == 0 && (!i4 || d->head_dim <= i4_max)
                        ? MH_READ_IN_PLACE : MH_READ_COPIED;
        ip.v_read = widens && d->v_dim % caps->lanes == 0 && (!i4 || d->v_dim <= i4_max)
                        ? MH_READ_IN_PLACE : MH_READ_COPIED;
    } else if (caps->pair_dot && d->kv_format == MH_STORE_BF16 &&
               d->q_format == MH_STORE_BF16 && d->head_dim % 2 == 0) {
        ip.path = MH_PATH_PAIRS; /* values are interleaved into pair words */
        ip.k_read = d->k_row_bytes <= MH_DIRECT_ROW_BYTES ? MH_READ_IN_PLACE : MH_READ_COPIED;
        ip.v_read = MH_READ_COPIED;
    } else {
        const int copied = widened ? MH_READ_WIDENED : MH_READ_COPIED;
        ip.path = MH_PATH_TILE;
        ip.k_read = native && d->k_row_bytes <= MH_DIRECT_ROW_BYTES ? MH_READ_IN_PLACE : copied;
        ip.v_read = native && d->v_dim % caps->lanes == 0 && d->v_row_bytes <= MH_DIRECT_ROW_BYTES
                        ? MH_READ_IN_PLACE : copied;
    }
    return ip;
}

int mh_plan_threads(int threads, int64_t n_items, double work, int contended)
{
    int64_t nt = threads < n_items ? threads : n_items;
    if (work < MH_SERIAL_WORK || (work < MH_SERIAL_WORK_CONTENDED && nt > 1 && contended))
        nt = 1;
    return nt > 1 ? (int)nt : 1;
}

void mh_plan_attention(const mh_call_desc *d, const mh_caps *caps, mh_plan *p)
{
    const int64_t E = d->head_dim, Ev = d->v_dim, S = d->kv_len;
    memset(p, 0, sizeof *p);
    p->group = mh_plan_group(d);
    p->n_pairs = d->n_pairs / p->group;
    const int64_t rows = d->q_len * p->group; /* query rows per pair */
    const int half_kv = d->kv_format == MH_STORE_F16 || d->kv_format == MH_STORE_BF16;
    int widened = 0;
    if (mh_plan_split(d)) {
        p->n_split = (S + MH_SPLIT_KEYS - 1) / MH_SPLIT_KEYS;
        p->split_keys = MH_SPLIT_KEYS;
        p->n_blocks = 1;
        p->n_items = p->n_pairs * p->n_split;
    } else {
        p->n_blocks = (rows + MH_BLOCK_Q - 1) / MH_BLOCK_Q;
        p->n_items = p->n_pairs * p->n_blocks;
    }
    p->work = (double)p->n_pairs * (double)rows * (double)S * (double)(E + Ev);
    p->threads = mh_plan_threads(d->threads, p->n_items, p->work, d->contended);
    if (p->n_split) { /* runs of ranges: as long as the threads keep enough items */
        int64_t run = p->n_items / ((int64_t)MH_SPLIT_ITEMS_PER_THREAD * p->threads);
        run = run < 1 ? 1 : run > MH_SPLIT_RUN ? MH_SPLIT_RUN : run;
        const int64_t per_pair = (p->n_split + run - 1) / run;
        p->split_run = (p->n_split + per_pair - 1) / per_pair; /* even runs */
        p->n_items = p->n_pairs * per_pair;
    }
    p->merge_threads = p->n_pairs < p->threads ? (int)(p->n_pairs > 1 ? p->n_pairs : 1)
                                               : p->threads;
    /* prefill over float16 / bfloat16 keys and values: each thread keeps the
       rows it widened for a pair, for that pair's next query blocks */
    if (!p->n_split && d->elem_size == 4 && p->group == 1 && rows > MH_BLOCK_Q && half_kv &&
        mh_widened_bytes(E, Ev, S) * (size_t)p->threads <= MH_WIDENED_BUDGET)
        widened = 1;
    {
        const int64_t last = rows - (p->n_blocks - 1) * MH_BLOCK_Q;
        p->item[1] = mh_plan_item(d, caps, p->n_split ? rows : last, p->group, widened);
        p->item[0] = p->n_blocks > 1 ? mh_plan_item(d, caps, MH_BLOCK_Q, p->group, widened)
                                     : p->item[1];
    }
    if (widened && (p->item[0].k_read == MH_READ_WIDENED || p->item[1].k_read == MH_READ_WIDENED))
        p->widened_rows = S;
    {   /* the call's keys and values in bytes (int4: half a byte an element) */
        const double elems = (double)p->n_pairs * (double)S * (double)(E + Ev);
        const int bits = mh_storage_bits(d->kv_format);
        p->prefetch = bits < 32 || elems * bits / 8 >= MH_PREFETCH_MIN_BYTES;
        p->prefetch_near = !mh_cpu_is_amd(); /* (read only where prefetch is set) */
    }
    p->i4_permutes = caps->byte_permutes && d->kv_format == MH_STORE_I4 && mh_byte_permutes();
    p->scratch_stride = mh_scratch_stride(E, Ev, (size_t)d->elem_size) +
                        (p->widened_rows ? mh_widened_bytes(E, Ev, S) : 0);
    p->partial_elems = p->n_split ? (size_t)(p->n_pairs * p->n_split * rows * (Ev + 2)) : 0;
}
