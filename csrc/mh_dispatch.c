/*
 * Run-time selection of the kernel path: which ISA files were compiled in,
 * and whether this CPU (and its OS, which must save the wider registers on a
 * context switch) can run them.  Compiled without any ISA flags.
 */
#include "mh_kernels.h"

extern const mh_kernel_table mh_table_baseline;
#if defined(__x86_64__) || defined(_M_X64)
#define MH_X86 1
extern const mh_kernel_table mh_table_avx2;
extern const mh_kernel_table mh_table_avx512;
#if defined(_MSC_VER)
#include <intrin.h>
#else
#include <cpuid.h>
#endif
#endif

size_t mh_scratch_bytes(int64_t head_dim, int64_t v_dim, size_t elem_size)
{
    /* mirrors the layout in mh_attention_impl.h; every part a multiple of 16 elements */
    const int64_t evp = (v_dim + 15) / 16 * 16;
    const int64_t qt = (head_dim * MH_BLOCK_Q + 15) / 16 * 16;
    const int64_t kpack = (head_dim + 15) / 16 * 16 * MH_BLOCK_K;
    const int64_t elems = qt + (int64_t)MH_BLOCK_K * MH_BLOCK_Q + (int64_t)MH_BLOCK_Q * evp +
                          kpack + (int64_t)MH_BLOCK_K * evp + 3 * MH_BLOCK_Q;
    return (size_t)elems * elem_size + 64;
}

#ifdef MH_X86
static void mh_cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
#if defined(_MSC_VER)
    int regs[4];
    __cpuidex(regs, (int)leaf, (int)sub);
    for (int i = 0; i < 4; ++i) r[i] = (unsigned)regs[i];
#else
    r[0] = r[1] = r[2] = r[3] = 0;
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
#endif
}

static unsigned long long mh_xgetbv0(void)
{
#if defined(_MSC_VER)
    return _xgetbv(0);
#else
    unsigned lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
#endif
}
#endif

int mh_cpu_supports(int isa)
{
    if (isa == MH_ISA_BASELINE) return 1;
#ifdef MH_X86
    unsigned r[4];
    mh_cpuid(0, 0, r);
    const unsigned max_leaf = r[0];
    if (max_leaf < 7) return 0;
    mh_cpuid(1, 0, r);
    const int osxsave = (r[2] >> 27) & 1, fma = (r[2] >> 12) & 1, avx = (r[2] >> 28) & 1;
    const int f16c = (r[2] >> 29) & 1;
    if (!osxsave || !avx) return 0;
    const unsigned long long xcr0 = mh_xgetbv0();
    const int os_ymm = (xcr0 & 0x6) == 0x6;     /* XMM and YMM state */
    const int os_zmm = (xcr0 & 0xe6) == 0xe6;   /* plus opmask and ZMM state */
    mh_cpuid(7, 0, r);
    const int avx2 = (r[1] >> 5) & 1, avx512f = (r[1] >> 16) & 1;
    if (isa == MH_ISA_AVX2) return os_ymm && avx2 && fma && f16c;
    if (isa == MH_ISA_AVX512) return os_ymm && os_zmm && avx2 && fma && f16c && avx512f;
#endif
    return 0;
}

int mh_isa_compiled(int isa)
{
#ifdef MH_X86
    return isa >= 0 && isa < MH_ISA_COUNT;
#else
    return isa == MH_ISA_BASELINE;
#endif
}

const mh_kernel_table *mh_kernels(int isa)
{
    switch (isa) {
    case MH_ISA_BASELINE: return &mh_table_baseline;
#ifdef MH_X86
    case MH_ISA_AVX2: return &mh_table_avx2;
    case MH_ISA_AVX512: return &mh_table_avx512;
#endif
    default: return 0;
    }
}
