/*
 * The avx512bf16 path: the AVX-512 kernels (mh_avx512.c) compiled again with
 * AVX512-BW and AVX512-BF16 enabled, which adds the bfloat16 pair-dot tile
 * path (vdpbf16ps) for bfloat16 queries, keys and values.  The dispatcher
 * picks it only on CPUs that report AVX512_BF16 (CPUID leaf 7, subleaf 1).
 * A compiler without those instructions builds no such path
 * (mh_avx512bf16_built = 0).
 */
#include "mh_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define MH_AVX512_DPBF16 1
#include "mh_avx512.c"
const int mh_avx512bf16_built = 1;
#else
const int mh_avx512bf16_built = 0;
const mh_kernel_table mh_table_avx512bf16 = {"avx512bf16", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
#endif
#endif
