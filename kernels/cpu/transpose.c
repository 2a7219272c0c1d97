/* Transposes of 16-bit elements: an F16 V cache as llama.cpp stores it without flash attention.
 *
 * Without flash attention llama.cpp keeps V transposed, [n_embd_v][cells], and its sequence-state blob
 * does too: the state backend turns each layer's V into cell rows [cells][n_embd_v] when it reads the
 * cache and back when it writes it, at every event and every swap. numpy copies a transposed view one
 * element at a time, striding through memory; here 8 x 8 tiles are transposed in registers (SSE2, the
 * x86-64 baseline) and written as 16-byte rows. Elements are moved as bits: exact for any 16-bit type. */

#include "kvlocal_kernels.h"

#include <stddef.h>
#include <stdint.h>

#if defined(__SSE2__)
#include <emmintrin.h>

/* the 8 x 8 tile at s (rows ss elements apart) transposed into d (rows ds apart) */
static inline void tile8(const uint16_t * s, ptrdiff_t ss, uint16_t * d, ptrdiff_t ds) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++) {
        r[i] = _mm_loadu_si128((const __m128i *) (s + i * ss));
    }
    for (int i = 0; i < 4; i++) {  /* pairs of rows interleaved: a[2i] columns 0-3, a[2i+1] columns 4-7 */
        a[2 * i]     = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {  /* rows 4i..4i+3: b[4i + j] holds columns 2j, 2j+1 */
        b[4 * i]     = _mm_unpacklo_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm_unpackhi_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {  /* column 2j, then 2j+1: rows 0-3 from b[j], rows 4-7 from b[4 + j] */
        _mm_storeu_si128((__m128i *) (d + (2 * j) * ds), _mm_unpacklo_epi64(b[j], b[4 + j]));
        _mm_storeu_si128((__m128i *) (d + (2 * j + 1) * ds), _mm_unpackhi_epi64(b[j], b[4 + j]));
    }
}
#endif

void kvl_transpose_u16(const unsigned short * src, long long src_stride, int rows, int cols,
                       unsigned short * dst, long long dst_stride) {
    int r0 = 0;
#if defined(__SSE2__)
    for (; r0 + 8 <= rows; r0 += 8) {
        int c0 = 0;
        for (; c0 + 8 <= cols; c0 += 8) {
            tile8(src + r0 * src_stride + c0, (ptrdiff_t) src_stride, dst + (ptrdiff_t) c0 * dst_stride + r0,
                  (ptrdiff_t) dst_stride);
        }
        for (int r = r0; r < r0 + 8; r++) {  /* the columns right of the last whole tile */
            for (int c = c0; c < cols; c++) {
                dst[(ptrdiff_t) c * dst_stride + r] = src[(ptrdiff_t) r * src_stride + c];
            }
        }
    }
#endif
    /* the rows below the last whole tile (all of them without SSE2), in tiles of 8 columns for locality */
    for (int c0 = 0; c0 < cols; c0 += 8) {
        int c1 = c0 + 8 < cols ? c0 + 8 : cols;
        for (int r = r0; r < rows; r++) {
            for (int c = c0; c < c1; c++) {
                dst[(ptrdiff_t) c * dst_stride + r] = src[(ptrdiff_t) r * src_stride + c];
            }
        }
    }
}
