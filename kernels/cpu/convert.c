/* Half-precision cache rows to float32, regrouped by head.
 *
 * An F16 KV cache reads as [n cells][h heads][d] (llama.cpp's row per cell); the scorers take each KV
 * head's rows contiguously, [h][n][d] float32, for every layer at every event. numpy converts half floats
 * element by element; F16C converts 8 per instruction. The conversion is exact (every half is a float),
 * so both paths give the same bits: `python -m tools.bench_kernels` times them side by side. */

#include "kvlocal_kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "simd.h"

#if KVL_X86_DISPATCH
#include <immintrin.h>
#endif

static void heads_generic(const uint16_t * src, int n, int n_head, int d, float * dst) {
    for (int h = 0; h < n_head; h++) {
        for (int i = 0; i < n; i++) {
            const uint16_t * s = src + ((ptrdiff_t) i * n_head + h) * d;
            float          * o = dst + ((ptrdiff_t) h * n + i) * d;
            for (int j = 0; j < d; j++) {
                o[j] = kvl_half_to_float(s[j]);
            }
        }
    }
}

#if KVL_X86_DISPATCH
__attribute__((target("avx2,f16c"))) static void heads_f16c(const uint16_t * src, int n, int n_head, int d, float * dst) {
    for (int h = 0; h < n_head; h++) {
        for (int i = 0; i < n; i++) {
            const uint16_t * s = src + ((ptrdiff_t) i * n_head + h) * d;
            float          * o = dst + ((ptrdiff_t) h * n + i) * d;
            int              j = 0;
            for (; j + 8 <= d; j += 8) {
                _mm256_storeu_ps(o + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s + j))));
            }
            for (; j < d; j++) {
                o[j] = kvl_half_to_float(s[j]);
            }
        }
    }
}
#endif

void kvl_f16_heads_f32(const unsigned short * src, int n, int n_head, int d, float * dst) {
#if KVL_X86_DISPATCH
    if (kvl_simd_active() >= 1 && __builtin_cpu_supports("f16c")) {
        heads_f16c(src, n, n_head, d, dst);
        return;
    }
#endif
    heads_generic(src, n, n_head, d, dst);
}
