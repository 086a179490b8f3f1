/* Run-time services for the Cython layer that also compile without OpenMP
   (then: one thread): OpenMP queries, a monotonic clock, and a flag that
   threads of one call share to stop early. */
#ifndef MANYHEADS_RUNTIME_H
#define MANYHEADS_RUNTIME_H
#ifdef _OPENMP
#include <omp.h>
static inline int mh_openmp_enabled(void) { return 1; }
static inline int mh_omp_max_threads(void) { return omp_get_max_threads(); }
static inline int mh_omp_version(void) { return _OPENMP; }
/* the address of an OpenMP entry point as this extension bound it (to find
   which runtime library serves it) */
static inline void *mh_omp_entry_address(void) { return (void *)&omp_get_max_threads; }
/* threads of the enclosing parallel region (1 outside one) */
static inline int mh_omp_team_size(void) { return omp_get_num_threads(); }
#else
static inline int mh_openmp_enabled(void) { return 0; }
static inline int mh_omp_max_threads(void) { return 1; }
static inline int mh_omp_version(void) { return 0; }
static inline void *mh_omp_entry_address(void) { return 0; }
static inline int mh_omp_team_size(void) { return 1; }
#endif

#if defined(_WIN32)
#include <windows.h>
static inline double mh_seconds(void) { return (double)GetTickCount64() * 1e-3; }
#else
#include <time.h>
static inline double mh_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#endif

/* A stop flag read by every thread of a call between work items. */
static inline int mh_flag_get(const volatile int *flag) { return *flag; }
static inline void mh_flag_set(volatile int *flag) { *flag = 1; }
#endif
