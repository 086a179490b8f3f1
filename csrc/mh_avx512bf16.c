/*
 * The avx512bf16 path: the AVX-512 float32 kernels (mh_avx512.c) compiled
 * again with AVX512-BW and AVX512-BF16 enabled, which adds the bfloat16
 * pair-product tile path (vdpbf16ps) for bfloat16 queries, keys and values,
 * and AVX512-VNNI, which adds integer dot products for int4 keys
 * (mh_i4_dots.h); float64 calls go to the avx512 path's kernels.  The
 * dispatcher picks it only on CPUs that report AVX512_BF16 (CPUID leaf 7,
 * subleaf 1) and AVX512_VNNI (leaf 7, ECX bit 11), which every CPU with
 * AVX512_BF16 has.  A compiler without those instructions (setup.py then drops
 * the flags) or a target other than x86-64 builds an empty table: no such
 * path.
 */
#include "mh_kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define MH_AVX512_DPBF16 1
#include "mh_avx512.c"
#else
MH_EMPTY_TABLE(avx512bf16)
#endif
