/*
 * Run-time selection of the kernel path: which ISA files were compiled in,
 * and whether this CPU (and its OS, which must save the wider registers on a
 * context switch) can run them, all from MH_ISA_LIST.  Also the storage
 * format table for the Python side.
 * Compiled without any ISA flags.
 */
#include "mh_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#define MH_X86 1
#if defined(_MSC_VER)
#include <intrin.h>
#else
#include <cpuid.h>
#endif
#endif

/* The kernel tables, one per entry of MH_ISA_LIST (empty when not built). */
#define MH_ISA_TABLE_DECL(ID, sfx, needs, file, flags, msvc) extern const mh_kernel_table mh_table_##sfx;
MH_ISA_LIST(MH_ISA_TABLE_DECL)
#undef MH_ISA_TABLE_DECL

#define MH_ISA_TABLE_PTR(ID, sfx, needs, file, flags, msvc) &mh_table_##sfx,
static const mh_kernel_table *const mh_tables[MH_ISA_COUNT] = {MH_ISA_LIST(MH_ISA_TABLE_PTR)};
#undef MH_ISA_TABLE_PTR

#define MH_ISA_NAME(ID, sfx, needs, file, flags, msvc) #sfx,
static const char *const mh_isa_names[MH_ISA_COUNT] = {MH_ISA_LIST(MH_ISA_NAME)};
#undef MH_ISA_NAME

#define MH_ISA_NEEDS(ID, sfx, needs, file, flags, msvc) needs,
static const unsigned mh_isa_needs[MH_ISA_COUNT] = {MH_ISA_LIST(MH_ISA_NEEDS)};
#undef MH_ISA_NEEDS

#define MH_STORAGE_ROW(ID, name, dtype, bits, scales, group) \
    {name, dtype, MH_STORE_##ID, bits, scales, group},
const mh_storage_info mh_storage_table[MH_STORAGE_COUNT] = {MH_STORAGE_LIST(MH_STORAGE_ROW)};
#undef MH_STORAGE_ROW

const char *mh_isa_name(int isa)
{
    return isa >= 0 && isa < MH_ISA_COUNT ? mh_isa_names[isa] : 0;
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
    mh_cpu_features f = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
#ifdef MH_X86
    unsigned r[4];
    mh_cpuid(0, 0, r);
    /* "AuthenticAMD" in EBX, EDX, ECX */
    f.amd = r[1] == 0x68747541u && r[3] == 0x69746e65u && r[2] == 0x444d4163u;
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
    f.avx512vnni = (r[2] >> 11) & 1;
    f.avx512vbmi = (r[2] >> 1) & 1;
    if (r[0] >= 1) { /* subleaf 1: EAX bit 5 is AVX512_BF16 */
        mh_cpuid(7, 1, r);
        f.avx512bf16 = (r[0] >> 5) & 1;
    }
#endif
    return f;
}

/* The MH_CPU_* features (mh_isa_list.h) this CPU and its OS provide. */
static unsigned mh_cpu_feature_bits(void)
{
    const mh_cpu_features f = mh_cpu_detect();
    unsigned bits = 0;
    if (f.avx && f.os_ymm && f.avx2 && f.fma && f.f16c) bits |= MH_CPU_AVX2;
    if (f.os_zmm && f.avx512f) bits |= MH_CPU_AVX512;
    if (f.avx512bw && f.avx512bf16 && f.avx512vnni) bits |= MH_CPU_AVX512BF16;
    return bits;
}

int mh_cpu_is_amd(void)
{
    /* (CPUID may trap to a hypervisor: asked once; threads racing store the same) */
    static volatile int known = -1;
    if (known < 0) known = mh_cpu_detect().amd;
    return known;
}

/* (-1: not asked yet; threads racing store the same) */
static volatile int mh_permutes_known = -1, mh_permutes_allowed = 1;

int mh_byte_permutes(void)
{
    if (mh_permutes_known < 0) {
        const mh_cpu_features f = mh_cpu_detect();
        mh_permutes_known = f.os_zmm && f.avx512bw && f.avx512vbmi;
    }
    return mh_permutes_known && mh_permutes_allowed;
}

int mh_set_byte_permutes(int allow)
{
    mh_permutes_allowed = allow != 0;
    return mh_byte_permutes();
}

int mh_cpu_supports(int isa)
{
    if (isa < 0 || isa >= MH_ISA_COUNT) return 0;
    return (mh_cpu_feature_bits() & mh_isa_needs[isa]) == mh_isa_needs[isa];
}

int mh_isa_compiled(int isa)
{
    return isa >= 0 && isa < MH_ISA_COUNT && mh_tables[isa]->name != 0;
}

const mh_kernel_table *mh_kernels(int isa)
{
    return mh_isa_compiled(isa) ? mh_tables[isa] : 0;
}
