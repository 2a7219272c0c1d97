/* Portable vector code for the scoring kernels, and run-time choice of the instruction set.
 *
 * The package is compiled once with baseline flags (no -march) and must run on any x86-64 and on
 * arm64. A kernel is therefore written once, in a template file (`*.inc`) over a vector type `vf` of
 * KVL_VW floats (GNU C vector extensions: GCC and Clang), and included several times:
 *
 *   generic  KVL_VW 4, no target attribute  (SSE2 on x86-64, NEON on arm64)
 *   avx2     KVL_VW 8, target("avx2,fma")                      x86-64 with GCC or Clang only
 *   avx512   KVL_VW 16, target("avx512f,avx512vl,avx2,fma")    x86-64 with GCC or Clang only
 *
 * and the exported function picks the widest one the CPU supports (kvl_simd_level caps it, for tests).
 * Other compilers (MSVC) get the generic template with KVL_VW 1: plain scalar C.
 *
 * GCC disables FMA contraction under -std=c11; the .c files turn it back on (`a += b * c` must become
 * one fused multiply-add on AVX2/AVX-512, one instruction where a multiply and an add would take two). */

#ifndef KVLOCAL_SIMD_H
#define KVLOCAL_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define KVL_X86_DISPATCH 1
#else
#define KVL_X86_DISPATCH 0
#endif

#if defined(__GNUC__)
#define KVL_INLINE static inline __attribute__((always_inline))
#else
#define KVL_INLINE static inline
#endif

#define KVL_CAT2(a, b) a##b
#define KVL_CAT(a, b)  KVL_CAT2(a, b)

/* 0 generic, 1 AVX2+FMA, 2 AVX-512: the widest supported by this CPU and allowed by kvl_simd_level */
int kvl_simd_active(void);

#endif
