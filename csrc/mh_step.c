/*
 * The small per-token steps of a decoder, in plain C (compiled without ISA flags, so
 * every build computes the same bits): RMSNorm, the rotary rotation, SwiGLU's
 * act(gate) * up, and the team barrier of a compiled decoding step.  The Cython
 * layer calls these both one at a time (rms_norm_rows, rotate_heads, silu_mul) and
 * from inside one parallel region for a whole step (DecodeProgram), so the two give
 * the same results.
 */
#define _POSIX_C_SOURCE 200112L /* sched_yield under -std=c99 */
#include "mh_kernels.h"
#include "mh_runtime.h"

#include <math.h>
#include <string.h>

#if defined(_WIN32)
#include <windows.h>
#define MH_YIELD() SwitchToThread()
#else
#include <sched.h>
#define MH_YIELD() sched_yield()
#endif

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#define MH_PAUSE() _mm_pause()
#else
#define MH_PAUSE() ((void)0)
#endif

void mh_rms_norm_rows(const float *x, int64_t rows, int64_t n, int64_t x_row,
                      const float *w, float eps, float *out, int64_t out_row)
{
    for (int64_t i = 0; i < rows; ++i) {
        const float *xi = x + i * x_row;
        float *oi = out + i * out_row;
        /* eight sums side by side (element j in sum j % 8), added pairwise at the
           end: a chain of n dependent additions took most of a decoding step's norm */
        double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)
            for (int u = 0; u < 8; ++u) s[u] += (double)xi[j + u] * xi[j + u];
        for (int u = 0; j < n; ++j, ++u) s[u] += (double)xi[j] * xi[j];
        const double ss = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        for (j = 0; j < n; ++j) oi[j] = (xi[j] * inv) * w[j];
    }
}

void mh_rotate_heads(float *x, int64_t B, int64_t H, int64_t T, int64_t sb, int64_t sh,
                     int64_t st, int64_t sd, int64_t n, const float *cos, const float *sin)
{
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < T; ++t) {
                float *row = x + b * sb + h * sh + t * st;
                const float *c = cos + t * n, *s = sin + t * n;
                for (int64_t i = 0; i < n; ++i) {
                    const float a = row[i * sd], e = row[(i + n) * sd];
                    row[i * sd] = a * c[i] - e * s[i];
                    row[(i + n) * sd] = e * c[i] + a * s[i];
                }
            }
}

/* The sigmoid's argument of a gated activation: g (SiLU), or 2 sqrt(2/pi) (g + 0.044715
   g^3) (GELU's tanh form: (1 + tanh(t)) / 2 = 1 / (1 + exp(-2 t))). */
static inline float mh_gate_arg(float g, int gelu)
{
    return gelu ? (g * g * 0.044715f + 1.0f) * g * 1.5957691216057308f : g;
}

/* g / (1 + e), e = exp(-a), where exp's argument was not clamped (`kept`), else the
   limit g * 0 (NaN for an infinite g): both taken, one kept by a mask, so that the
   loops around it run on whole vectors. */
static inline float mh_gate_times_sigmoid(float g, float e, int kept)
{
    const float sig = g / (1.0f + e), lim = g * 0.0f;
    const uint32_t keep = 0u - (uint32_t)kept;
    uint32_t bs, bl;
    float r;
    memcpy(&bs, &sig, 4);
    memcpy(&bl, &lim, 4);
    bs = (bs & keep) | (bl & ~keep);
    memcpy(&r, &bs, 4);
    return r;
}

/* One row of mh_gated_rows; gelu a constant where it is inlined, and no branch in
   either loop, so that both run on whole vectors. */
static inline void mh_gated_row(const float *g, const float *u, int64_t F, const int gelu,
                                float *o, void (*exp_f32)(const float *x, float *y, int64_t n))
{
    /* exp(-a), its argument clamped where it would overflow (NaN stays NaN) */
    for (int64_t j = 0; j < F; ++j) {
        const float na = -mh_gate_arg(g[j], gelu);
        o[j] = na < 88.0f ? na : 88.0f;
    }
    if (F) exp_f32(o, o, F);
    /* g / (1 + exp(-a)) * u; where the argument was clamped (or is NaN) the limit
       g * 0 * u instead (NaN for an infinite g or u) */
    for (int64_t j = 0; j < F; ++j)
        o[j] = mh_gate_times_sigmoid(g[j], o[j], -mh_gate_arg(g[j], gelu) < 88.0f) * u[j];
}

void mh_gated_rows(const float *gu, int64_t rows, int64_t F, int64_t gu_row, int gelu,
                   float *out, int64_t out_row,
                   void (*exp_f32)(const float *x, float *y, int64_t n))
{
    for (int64_t i = 0; i < rows; ++i) {
        const float *g = gu + i * gu_row;
        if (gelu)
            mh_gated_row(g, g + F, F, 1, out + i * out_row, exp_f32);
        else
            mh_gated_row(g, g + F, F, 0, out + i * out_row, exp_f32);
    }
}

void mh_clamped_gated_rows(const float *gu, int64_t rows, int64_t F, int64_t gu_row,
                           float alpha, float limit, float *out, int64_t out_row,
                           void (*exp_f32)(const float *x, float *y, int64_t n))
{
    for (int64_t i = 0; i < rows; ++i) {
        const float *g = gu + i * gu_row, *u = g + F;
        float *o = out + i * out_row;
        /* exp(-alpha min(g, limit)), its argument clamped where it would overflow (NaN
           stays NaN: every comparison below is false for it) */
        for (int64_t j = 0; j < F; ++j) {
            const float gc = g[j] > limit ? limit : g[j], na = -alpha * gc;
            o[j] = na < 88.0f ? na : 88.0f;
        }
        if (F) exp_f32(o, o, F);
        /* gc / (1 + exp(-alpha gc)) * (clamp(u, -limit, limit) + 1); gc * 0 where the
           argument was clamped (or is NaN) */
        for (int64_t j = 0; j < F; ++j) {
            const float gc = g[j] > limit ? limit : g[j];
            const float uc = (u[j] < -limit ? -limit : u[j] > limit ? limit : u[j]) + 1.0f;
            o[j] = mh_gate_times_sigmoid(gc, o[j], -alpha * gc < 88.0f) * uc;
        }
    }
}

/* A waiting thread spins for MH_SPIN_SECONDS, longer than a phase's imbalance on a
   quiet machine, then yields its core at every turn (a thread of the team without a
   core gets one back soon); a wait longer than MH_LONG_WAIT_SECONDS is counted. */
#define MH_SPIN_SECONDS 2e-4
#define MH_LONG_WAIT_SECONDS 1e-3

static int mh_barrier_passed(mh_team_barrier_t *b, long gen)
{
#if defined(_MSC_VER) && !defined(__clang__)
    _ReadWriteBarrier();
    return b->gen != gen;
#else
    return __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) != gen;
#endif
}

int mh_team_barrier(mh_team_barrier_t *b, int n)
{
    if (n <= 1) return 0;
#if defined(_MSC_VER) && !defined(__clang__)
    const long gen = b->gen;
    _ReadWriteBarrier();
    if (_InterlockedIncrement(&b->count) == n) {
        b->count = 0;
        _InterlockedIncrement(&b->gen);
        return 0;
    }
#else
    const long gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == n) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->gen, gen + 1, __ATOMIC_RELEASE);
        return 0;
    }
#endif
    for (int i = 0; i < 256; ++i) { /* the usual wait: a few microseconds */
        if (mh_barrier_passed(b, gen)) return 0;
        MH_PAUSE();
    }
    const double start = mh_seconds();
    double now = start;
    while (!mh_barrier_passed(b, gen)) {
        if (now - start < MH_SPIN_SECONDS) {
            /* the flag is looked at after every pause (a pause takes 30-140 ns: 64 of
               them between looks left the waiting thread up to 2-9 us late) */
            for (int i = 0; i < 64 && !mh_barrier_passed(b, gen); ++i) MH_PAUSE();
        } else {
            MH_YIELD();
        }
        now = mh_seconds();
    }
    return now - start > MH_LONG_WAIT_SECONDS;
}

void mh_read_ahead_until_arrival(const char *p, int64_t n, mh_team_barrier_t *b)
{
    for (int64_t off = 0; off < n; off += 64) {
#if defined(_MSC_VER) && !defined(__clang__)
        if ((off & 1023) == 0 && b->count != 0) return;
#else
        if ((off & 1023) == 0 && __atomic_load_n(&b->count, __ATOMIC_RELAXED) != 0) return;
#endif
        MH_PREFETCH(p + off);
    }
}

int64_t mh_next_item(volatile long *counter)
{
#if defined(_MSC_VER) && !defined(__clang__)
    return (int64_t)_InterlockedIncrement(counter) - 1;
#else
    return (int64_t)__atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
#endif
}
