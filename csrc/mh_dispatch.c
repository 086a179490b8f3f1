/*
 * Run-time selection of the kernel path: which ISA files were compiled in,
 * and whether this CPU (and its OS, which must save the wider registers on a
 * context switch) can run them.  Also the one plan of a work item's scratch.
 * Compiled without any ISA flags.
 */
#include "mh_kernels.h"

extern const mh_kernel_table mh_table_baseline;
#if defined(__x86_64__) || defined(_M_X64)
#define MH_X86 1
extern const mh_kernel_table mh_table_avx2;
extern const mh_kernel_table mh_table_avx512;
extern const mh_kernel_table mh_table_avx512bf16;
extern const int mh_avx512bf16_built; /* 0 if the compiler had no AVX512-BF16 */
#if defined(_MSC_VER)
#include <intrin.h>
#else
#include <cpuid.h>
#endif
#endif

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

static const char *const mh_isa_names[MH_ISA_COUNT] = {"baseline", "avx2", "avx512",
                                                       "avx512bf16"};
static const int mh_isa_preference[MH_ISA_COUNT] = {MH_ISA_AVX512BF16, MH_ISA_AVX512, MH_ISA_AVX2,
                                                    MH_ISA_BASELINE};

const char *mh_isa_name(int isa)
{
    return isa >= 0 && isa < MH_ISA_COUNT ? mh_isa_names[isa] : 0;
}

int mh_isa_by_preference(int rank)
{
    return rank >= 0 && rank < MH_ISA_COUNT ? mh_isa_preference[rank] : -1;
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

mh_cpu_features mh_cpu_detect(void)
{
    mh_cpu_features f = {0, 0, 0, 0, 0, 0, 0, 0, 0};
#ifdef MH_X86
    unsigned r[4];
    mh_cpuid(0, 0, r);
    if (r[0] < 7) return f; /* no leaf 7: no AVX2 */
    mh_cpuid(1, 0, r);
    f.fma = (r[2] >> 12) & 1;
    f.f16c = (r[2] >> 29) & 1;
    f.avx = (r[2] >> 28) & 1;
    if ((r[2] >> 27) & 1) { /* OSXSAVE: XGETBV is allowed */
        const unsigned long long xcr0 = mh_xgetbv0();
        f.os_ymm = (xcr0 & 0x6) == 0x6;   /* XMM and YMM state */
        f.os_zmm = (xcr0 & 0xe6) == 0xe6; /* plus opmask and ZMM state */
    }
    mh_cpuid(7, 0, r);
    f.avx2 = (r[1] >> 5) & 1;
    f.avx512f = (r[1] >> 16) & 1;
    f.avx512bw = (r[1] >> 30) & 1;
    if (r[0] >= 1) { /* subleaf 1: EAX bit 5 is AVX512_BF16 */
        mh_cpuid(7, 1, r);
        f.avx512bf16 = (r[0] >> 5) & 1;
    }
#endif
    return f;
}

int mh_cpu_supports(int isa)
{
    const mh_cpu_features f = mh_cpu_detect();
    const int avx2 = f.avx && f.os_ymm && f.avx2 && f.fma && f.f16c;
    switch (isa) {
    case MH_ISA_BASELINE: return 1;
    case MH_ISA_AVX2: return avx2;
    case MH_ISA_AVX512: return avx2 && f.os_zmm && f.avx512f;
    case MH_ISA_AVX512BF16: return avx2 && f.os_zmm && f.avx512f && f.avx512bw && f.avx512bf16;
    default: return 0;
    }
}

int mh_isa_compiled(int isa)
{
#ifdef MH_X86
    if (isa == MH_ISA_AVX512BF16) return mh_avx512bf16_built;
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
    case MH_ISA_AVX512BF16: return mh_avx512bf16_built ? &mh_table_avx512bf16 : 0;
#endif
    default: return 0;
    }
}
