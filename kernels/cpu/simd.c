#include "kvlocal_kernels.h"

#include "simd.h"

static int level_cap = 2;

static int level_cpu(void) {
#if KVL_X86_DISPATCH
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return 2;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return 1;
    }
#endif
    return 0;
}

int kvl_simd_active(void) {
    const int cpu = level_cpu();
    return cpu < level_cap ? cpu : level_cap;
}

int kvl_simd_level(int cap) {
    if (cap >= 0) {
        level_cap = cap;
    }
    return kvl_simd_active();
}
