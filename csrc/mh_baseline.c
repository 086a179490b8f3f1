/*
 * Portable baseline instantiation of the attention kernels: plain C99 on a
 * 4-lane struct "vector" that compilers map onto whatever the target's
 * baseline SIMD is (SSE2 on x86-64, NEON on aarch64), or scalar code.
 * Compiled with no ISA flags; runs on every CPU the wheel supports.
 */
#include <math.h>
#include "mh_kernels.h"

typedef struct { float x[4]; } mh_v4f;
typedef struct { double x[4]; } mh_v4d;

#define MH_LANEWISE(VT, name, expr)                                 \
    static inline VT name(VT a, VT b)                               \
    {                                                               \
        VT r;                                                       \
        for (int l = 0; l < 4; ++l) r.x[l] = (expr);                \
        return r;                                                   \
    }

/* max keeps b when a lane is NaN-vs-number, like the x86 instructions do
   with operands swapped: a NaN in `b` is returned. */
MH_LANEWISE(mh_v4f, v4f_add, a.x[l] + b.x[l])
MH_LANEWISE(mh_v4f, v4f_sub, a.x[l] - b.x[l])
MH_LANEWISE(mh_v4f, v4f_mul, a.x[l] * b.x[l])
MH_LANEWISE(mh_v4f, v4f_max, a.x[l] > b.x[l] ? a.x[l] : b.x[l])
MH_LANEWISE(mh_v4d, v4d_add, a.x[l] + b.x[l])
MH_LANEWISE(mh_v4d, v4d_sub, a.x[l] - b.x[l])
MH_LANEWISE(mh_v4d, v4d_mul, a.x[l] * b.x[l])
MH_LANEWISE(mh_v4d, v4d_max, a.x[l] > b.x[l] ? a.x[l] : b.x[l])

#define MH_UNARY(VT, ST, name, expr)                                \
    static inline VT name(VT a)                                     \
    {                                                               \
        VT r;                                                       \
        for (int l = 0; l < 4; ++l) {                               \
            ST t = a.x[l];                                          \
            r.x[l] = (expr);                                        \
        }                                                           \
        return r;                                                   \
    }
MH_UNARY(mh_v4f, float, v4f_exp, expf(t))
MH_UNARY(mh_v4f, float, v4f_ninf0, t == -INFINITY ? 0.0f : t)
MH_UNARY(mh_v4d, double, v4d_exp, exp(t))
MH_UNARY(mh_v4d, double, v4d_ninf0, t == -INFINITY ? 0.0 : t)

static inline mh_v4f v4f_set1(float s) { mh_v4f r = {{s, s, s, s}}; return r; }
static inline mh_v4d v4d_set1(double s) { mh_v4d r = {{s, s, s, s}}; return r; }
static inline mh_v4f v4f_load(const float *p) { mh_v4f r = {{p[0], p[1], p[2], p[3]}}; return r; }
static inline mh_v4d v4d_load(const double *p) { mh_v4d r = {{p[0], p[1], p[2], p[3]}}; return r; }
static inline void v4f_store(float *p, mh_v4f v) { for (int l = 0; l < 4; ++l) p[l] = v.x[l]; }
static inline void v4d_store(double *p, mh_v4d v) { for (int l = 0; l < 4; ++l) p[l] = v.x[l]; }

/* ---------------------------------------------------------------- float32 */
#define T float
#define V mh_v4f
#define VW 4
#define NVQ 2
#define JR 4
#define NVO 2
#define IR 4
#define FN(x) x##_f32_baseline
#define V_ZERO() v4f_set1(0.0f)
#define V_SET1(x) v4f_set1(x)
#define V_LOAD(p) v4f_load(p)
#define V_STORE(p, v) v4f_store((p), (v))
#define V_ADD(a, b) v4f_add((a), (b))
#define V_SUB(a, b) v4f_sub((a), (b))
#define V_MUL(a, b) v4f_mul((a), (b))
#define V_MAX(a, b) v4f_max((a), (b))
#define V_FMA(a, b, c) v4f_add(v4f_mul((a), (b)), (c))
#define V_EXP(x) v4f_exp(x)
#define V_NEG_INF_TO_ZERO(x) v4f_ninf0(x)
#define V_HSUM(v) (((v).x[0] + (v).x[1]) + ((v).x[2] + (v).x[3]))
#include "mh_attention_impl.h"

/* ---------------------------------------------------------------- float64 */
#define T double
#define V mh_v4d
#define VW 4
#define NVQ 2
#define JR 4
#define NVO 2
#define IR 4
#define FN(x) x##_f64_baseline
#define V_ZERO() v4d_set1(0.0)
#define V_SET1(x) v4d_set1(x)
#define V_LOAD(p) v4d_load(p)
#define V_STORE(p, v) v4d_store((p), (v))
#define V_ADD(a, b) v4d_add((a), (b))
#define V_SUB(a, b) v4d_sub((a), (b))
#define V_MUL(a, b) v4d_mul((a), (b))
#define V_MAX(a, b) v4d_max((a), (b))
#define V_FMA(a, b, c) v4d_add(v4d_mul((a), (b)), (c))
#define V_EXP(x) v4d_exp(x)
#define V_NEG_INF_TO_ZERO(x) v4d_ninf0(x)
#define V_HSUM(v) (((v).x[0] + (v).x[1]) + ((v).x[2] + (v).x[3]))
#include "mh_attention_impl.h"

const mh_kernel_table mh_table_baseline = {
    "baseline", mh_fwd_item_f32_baseline, mh_fwd_item_f64_baseline, mh_split_item_f32_baseline, mh_split_item_f64_baseline,
    mh_merge_item_f32_baseline, mh_merge_item_f64_baseline, mh_exp_array_f32_baseline, mh_exp_array_f64_baseline};
