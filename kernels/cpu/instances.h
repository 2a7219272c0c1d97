/* One instance of a kernel template per instruction set (simd.h): generic (4 lanes: SSE2 or NEON; scalar for
 * other compilers and under KVL_FORCE_SCALAR, which checks the MSVC path with GCC), then AVX2 and AVX-512 on
 * x86-64. The includer defines KVL_TEMPLATE, the template's file name, and includes this once. */

#if defined(__GNUC__) && !defined(KVL_FORCE_SCALAR)
#define KVL_VW     4
#else
#define KVL_VW     1
#endif
#define KVL_SFX    generic
#define KVL_TARGET
#include KVL_TEMPLATE
#undef KVL_VW
#undef KVL_SFX
#undef KVL_TARGET

#if KVL_X86_DISPATCH
#define KVL_VW     8
#define KVL_SFX    avx2
#define KVL_TARGET __attribute__((target("avx2,fma")))
#include KVL_TEMPLATE
#undef KVL_VW
#undef KVL_SFX
#undef KVL_TARGET

#define KVL_VW     16
#define KVL_SFX    avx512
#define KVL_TARGET __attribute__((target("avx512f,avx512vl,avx2,fma")))
#include KVL_TEMPLATE
#undef KVL_VW
#undef KVL_SFX
#undef KVL_TARGET
#endif
