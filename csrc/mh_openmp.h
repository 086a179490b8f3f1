/* OpenMP queries that also compile without OpenMP (then: one thread). */
#ifndef MANYHEADS_OPENMP_H
#define MANYHEADS_OPENMP_H
#ifdef _OPENMP
#include <omp.h>
static inline int mh_openmp_enabled(void) { return 1; }
static inline int mh_omp_max_threads(void) { return omp_get_max_threads(); }
static inline int mh_omp_version(void) { return _OPENMP; }
#else
static inline int mh_openmp_enabled(void) { return 0; }
static inline int mh_omp_max_threads(void) { return 1; }
static inline int mh_omp_version(void) { return 0; }
#endif
#endif
