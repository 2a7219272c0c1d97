/* Projected value norms ||v · W_O^h||_p (p = 1 or 2), averaged over the query heads of a GQA group (CriticalKV).
 *
 * An [m, d] x [d, D] product per query head followed by an L1 or L2 reduction over D, fused: a chunk of
 * W_O^h stays in L1, blocks of 4 rows x 2 vectors of columns are accumulated in registers and reduced
 * at once, so the [m, D] products are never written out (numpy's matmul + abs + sum moves them
 * through memory three times). For L2 the caller may pass a [d, d] factor of W_O^h instead of W_O^h
 * (kvlocal.compress.criticalkv.l2_factor): the same norm at d/D of the work. */

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#endif

#include "kvlocal_kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__GNUC__) && !defined(KVL_FORCE_SCALAR) /* KVL_FORCE_SCALAR: check the MSVC path with GCC */
#define KVL_VW     4
#else
#define KVL_VW     1
#endif
#define KVL_SFX    generic
#define KVL_NV     2
#define KVL_TARGET
#include "vnorm.inc"
#undef KVL_VW
#undef KVL_SFX
#undef KVL_NV
#undef KVL_TARGET

#if KVL_X86_DISPATCH
#define KVL_VW     8
#define KVL_SFX    avx2
#define KVL_NV     2
#define KVL_TARGET __attribute__((target("avx2,fma")))
#include "vnorm.inc"
#undef KVL_VW
#undef KVL_SFX
#undef KVL_NV
#undef KVL_TARGET

#define KVL_VW     16
#define KVL_SFX    avx512
#define KVL_NV     4
#define KVL_TARGET __attribute__((target("avx512f,avx512vl,avx2,fma")))
#include "vnorm.inc"
#undef KVL_VW
#undef KVL_SFX
#undef KVL_NV
#undef KVL_TARGET
#endif

int kvl_vnorm_f32(const float * v, int n, int d, const float * wo, int ld, int n_group, int D, int p,
                  const int * rows, int n_rows, float * out) {
    if (n < 0 || d <= 0 || n_group <= 0 || D < 0 || ld < n_group * d || n_rows < 0 || (!rows && n_rows != n) ||
        (p != 1 && p != 2)) {
        return -1;
    }
    for (int r = 0; rows && r < n_rows; r++) {
        if (rows[r] < 0 || rows[r] >= n) {
            return -1;
        }
    }
#if KVL_X86_DISPATCH
    switch (kvl_simd_active()) {
        case 2: return vnorm_avx512(v, d, wo, ld, n_group, D, p, rows, n_rows, out);
        case 1: return vnorm_avx2(v, d, wo, ld, n_group, D, p, rows, n_rows, out);
        default: break;
    }
#endif
    return vnorm_generic(v, d, wo, ld, n_group, D, p, rows, n_rows, out);
}
