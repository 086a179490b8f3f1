/*
 * Storage formats: how the elements of an operand (queries, keys, values,
 * outputs) are stored.  The one table of them: the C enum, the kernels'
 * bytes per element and the int4 group size here, and, through
 * mh_storage_info (mh_dispatch.c) and manyheads._formats, the Python side:
 * cache allocation, quantize/dequantize, error messages, the benchmark's
 * lists.
 *
 *   X(ID, "name", "NumPy dtype of the stored elements", bits, scales, group)
 *
 *   ID      enum suffix: MH_STORE_<ID>
 *   bits    bits per element (int4: two elements per byte)
 *   scales  what a stored row carries beside its elements (mh_scales)
 *   group   channels that share one scale entry (0: the whole row)
 *
 * A kernel of float type T reads its own type (F32 or F64) natively; the
 * other formats serve float32 kernels and are widened as they are read.
 *   F16   IEEE half, as uint16 bits
 *   BF16  bfloat16, as uint16 bits (the high half of a float32)
 *   I8    symmetric: value = q * scale, one float32 scale per row
 *   I4    asymmetric in groups: byte c of a row holds channels 2c (low
 *         nibble) and 2c+1 (high nibble), value = q * scale + min, one
 *         (scale, min) pair of float16 bits per group
 */
#ifndef MANYHEADS_FORMATS_H
#define MANYHEADS_FORMATS_H

enum mh_scales {
    MH_SCALES_NONE = 0,     /* no scales */
    MH_SCALES_ROW_F32 = 1,  /* one float32 per row */
    MH_SCALES_PAIRS_F16 = 2 /* (scale, min) float16 pairs, one per group */
};

#define MH_STORAGE_LIST(X)                                   \
    X(F32, "float32", "float32", 32, MH_SCALES_NONE, 0)      \
    X(F64, "float64", "float64", 64, MH_SCALES_NONE, 0)      \
    X(F16, "float16", "float16", 16, MH_SCALES_NONE, 0)      \
    X(BF16, "bfloat16", "bfloat16", 16, MH_SCALES_NONE, 0)   \
    X(I8, "int8", "int8", 8, MH_SCALES_ROW_F32, 0)           \
    X(I4, "int4", "uint8", 4, MH_SCALES_PAIRS_F16, 32)

#define MH_STORAGE_ENUM(ID, name, dtype, bits, scales, group) MH_STORE_##ID,
enum mh_storage { MH_STORAGE_LIST(MH_STORAGE_ENUM) MH_STORAGE_COUNT };
#undef MH_STORAGE_ENUM

#define MH_STORAGE_GROUP(ID, name, dtype, bits, scales, group) MH_GROUP_##ID = group,
enum mh_storage_group { MH_STORAGE_LIST(MH_STORAGE_GROUP) MH_GROUP_COUNT_ };
#undef MH_STORAGE_GROUP

/* channels per (scale, min) pair of an int4 row */
#define MH_I4_GROUP ((int64_t)MH_GROUP_I4)

/* Bits per element of format `fmt` (0 for an unknown code). */
static inline int mh_storage_bits(int fmt)
{
    switch (fmt) {
#define MH_STORAGE_BITS(ID, name, dtype, bits, scales, group) case MH_STORE_##ID: return bits;
    MH_STORAGE_LIST(MH_STORAGE_BITS)
#undef MH_STORAGE_BITS
    default: return 0;
    }
}

/* One row of the table, for the Python side (mh_storage_table). */
typedef struct mh_storage_info {
    const char *name, *dtype;
    int code, bits, scales, group;
} mh_storage_info;

#endif /* MANYHEADS_FORMATS_H */
