/*
 * One instantiation of the attention and projection kernels for one (ISA,
 * float type).  An ISA file maps the vector vocabulary below onto its
 * intrinsics, declares what it can do, and includes this file once per
 * float type; the names it defines carry the suffix FN() appends.
 *
 * Vocabulary (every ISA):
 *   T            scalar type (float or double)
 *   V            vector type holding VW lanes of T
 *   VW           lanes per vector
 *   NVQ, JR      score tile: NVQ query vectors x JR keys in registers
 *   NVO, IR      output tile: IR query rows x NVO value vectors in registers
 *   FN(x)        x with the (type, ISA) suffix appended
 *   V_ZERO() V_SET1(x) V_LOAD(p) V_STORE(p, v)          (unaligned memory)
 *   V_ADD V_SUB V_MUL V_DIV V_MAX(a, b) V_FMA(a, b, c) = a*b+c
 *   V_EXP(v)     exp per lane; exp(-inf) = 0; NaN stays NaN
 *   V_NEG_INF_TO_ZERO(v)  lanes equal to -inf become 0
 *   V_HSUM(v)    sum of the lanes
 *
 * Capabilities: an ISA file defines to 1 each it has (with the vocabulary it
 * names); the others are 0.
 *   MH_HAS_EXP2        V_EXP2(v): 2^x per lane for x <= 0 or NaN; 2^-inf = 0
 *   MH_HAS_TRANSPOSE   V_TRANSPOSE(r): transpose the VW x VW block in V r[VW]
 *   MH_HAS_HSUM4       V_HSUM4(a, b, c, d, out): out[0..4) = the lane sums
 *   MH_HAS_SELECT      VM, V_MARK_HIDDEN(p, s), V_VISIBLE(p),
 *                      V_FMA_VISIBLE(a, b, c, m): vector selects for hidden
 *                      entries (see MH_IS_HIDDEN in mh_common.h);
 *                      V_WHERE_SMALL(x, t, a, b): a where |x| < t, else b
 *   MH_HAS_F16_LOAD    V_LOAD_HALF(p): VW float16 values widened to V
 *   MH_HAS_BF16_LOAD   V_LOAD_BF16(p): VW bfloat16 values widened to V
 *   MH_HAS_I8_LOAD     V_LOAD_I8(p): VW int8 values converted to V
 *   MH_HAS_I8_PAIRS    V_I8_WIDEN(p): a blocked int8 pass (mh_linear_index)
 *                      of VW columns widened for V_I8_DOT(W, xp), of type
 *                      VI8; V_I8_DOT(W, xp): its exact sums times four pairs
 *                      of 16-bit integers (the bits of each lane of
 *                      xp[0..4)), converted to V; V_LOAD_I8_PAIRS(p, e, o): a
 *                      pair of rows of VW columns widened to V e (even row)
 *                      and o (odd row)
 *   MH_HAS_U4_LOAD     V_LOAD_U4(p): VW 4-bit values from VW/2 bytes (low
 *                      nibble first) converted to V
 *   MH_HAS_U4_SPLIT    V_LOAD_U4_GROUP(p, u): the MH_I4_GROUP / VW vectors
 *                      u[0..) of a group of 4-bit values (MH_I4_GROUP / 2
 *                      bytes) in split order: the group's even channels, then
 *                      its odd ones (see FN(u4_row)); V_SPLIT_GROUP(u),
 *                      V_UNSPLIT_GROUP(u): a group's vectors from channel
 *                      order to split order and back
 *   MH_HAS_HALF_STORE  V_STORE_HALF(p, v), V_STORE_BF16(p, v): v rounded to
 *                      VW float16 / bfloat16 values (nearest even, NaN stays
 *                      NaN) stored at p
 *   MH_HAS_HALF_SCALAR S_HALF_TO_FLOAT(h), S4_HALF_TO_FLOAT(dst, src): one and
 *                      four float16 values (bits) to float in an instruction
 *   MH_HAS_BF16_DOT    V_DPBF16(acc, a, b) and VP, VP_LOAD, VP_STORE, VP_SET1,
 *                      VP_LOW, VP_HIGH, VP_AS_V, VP_PAIR, VP_INTERLEAVE: the
 *                      bfloat16 pair-product tile path (mh_pair_bf16.h)
 * The half and integer loads and stores serve the float32 instantiations.
 *
 * The pieces, each in its own file:
 *   mh_common.h     masks, dropout, widening loads, the work item's scratch
 *   mh_scores.h     soft cap and ALiBi on the scores, sinks and log-sum-exp
 *   mh_tile.h       the tile path (blocks of query rows)
 *   mh_pair_bf16.h  the tile path's bfloat16 pair products (MH_HAS_BF16_DOT)
 *   mh_few_rows.h   the few-rows path (decode)
 *   mh_kv_rows.h    its stored K/V rows in place, and asking for them ahead
 *   mh_entry.h      the entry points of mh_kernel_table
 *   mh_linear_impl.h  the few-rows dense projection
 * Scores are kept in log2 units throughout: see mh_common.h.
 */
#ifndef MH_HAS_EXP2
#define MH_HAS_EXP2 0
#endif
#ifndef MH_HAS_TRANSPOSE
#define MH_HAS_TRANSPOSE 0
#endif
#ifndef MH_HAS_HSUM4
#define MH_HAS_HSUM4 0
#endif
#ifndef MH_HAS_SELECT
#define MH_HAS_SELECT 0
#endif
#ifndef MH_HAS_F16_LOAD
#define MH_HAS_F16_LOAD 0
#endif
#ifndef MH_HAS_BF16_LOAD
#define MH_HAS_BF16_LOAD 0
#endif
#ifndef MH_HAS_I8_LOAD
#define MH_HAS_I8_LOAD 0
#endif
#ifndef MH_HAS_I8_PAIRS
#define MH_HAS_I8_PAIRS 0
#endif
#ifndef MH_HAS_U4_LOAD
#define MH_HAS_U4_LOAD 0
#endif
#ifndef MH_HAS_U4_SPLIT
#define MH_HAS_U4_SPLIT 0
#endif
#ifndef MH_HAS_HALF_STORE
#define MH_HAS_HALF_STORE 0
#endif
#ifndef MH_HAS_HALF_SCALAR
#define MH_HAS_HALF_SCALAR 0
#endif
#ifndef MH_HAS_BF16_DOT
#define MH_HAS_BF16_DOT 0
#endif
#ifndef MH_HAS_I4_DOTS
#define MH_HAS_I4_DOTS 0
#endif

#if MH_HAS_BF16_DOT && !MH_HAS_TRANSPOSE
#error "the pair-product path loads its queries through V_TRANSPOSE"
#endif

#include "mh_common.h"
#include "mh_scores.h"
#if MH_HAS_BF16_DOT
#include "mh_pair_bf16.h"
#endif
#include "mh_tile.h"
#include "mh_few_rows.h"
#include "mh_entry.h"
#include "mh_linear_impl.h"
#include "mh_isa_end.h"
