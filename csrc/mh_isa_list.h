/*
 * Every kernel path, best first: the one list that the C dispatcher (enum,
 * names, preference order, kernel tables, CPU checks) and the build
 * (setup.py: which file, which compiler flags) read.
 *
 *   X(ID, sfx, needs, "file", "gcc/clang flags", "MSVC flags")
 *
 *   ID     enum suffix: MH_ISA_<ID>
 *   sfx    the path's name and the suffix of its symbols (mh_table_<sfx>)
 *   needs  CPU features the path needs (mh_cpu_features bits, MH_CPU_*)
 *   file   the source file that defines mh_table_<sfx>
 *   flags  what that file is compiled with on an x86-64 target (elsewhere:
 *          nothing; an x86 file then defines an empty table)
 *
 * setup.py reads the X(...) entries below with a regular expression: keep
 * the fields in this order, the strings double-quoted.
 */
#ifndef MANYHEADS_ISA_LIST_H
#define MANYHEADS_ISA_LIST_H

#define MH_CPU_AVX2 1u       /* AVX2, FMA, F16C and the OS saving YMM state */
#define MH_CPU_AVX512 2u     /* AVX-512F and the OS saving opmask and ZMM state */
#define MH_CPU_AVX512BF16 4u /* AVX512-BW, AVX512-BF16 and AVX512-VNNI */

#define MH_ISA_LIST(X)                                                                        \
    X(AVX512BF16, avx512bf16, MH_CPU_AVX2 | MH_CPU_AVX512 | MH_CPU_AVX512BF16,                 \
      "mh_avx512bf16.c", "-mavx512f -mavx2 -mfma -mf16c -mavx512bw -mavx512bf16 -mavx512vnni", \
      "/arch:AVX512")                                                                         \
    X(AVX512, avx512, MH_CPU_AVX2 | MH_CPU_AVX512,                                            \
      "mh_avx512.c", "-mavx512f -mavx2 -mfma -mf16c", "/arch:AVX512")                          \
    X(AVX2, avx2, MH_CPU_AVX2,                                                                \
      "mh_avx2.c", "-mavx2 -mfma -mf16c", "/arch:AVX2")                                         \
    X(BASELINE, baseline, 0u,                                                                 \
      "mh_baseline.c", "", "")

#endif /* MANYHEADS_ISA_LIST_H */
