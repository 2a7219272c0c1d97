/* Window attention votes: the mean, over a window of queries, of their softmax over the cached keys.
 *
 * The hot loop of SnapKV-style scoring. Keys are transposed once per KV head, in blocks of one register
 * block's keys ([n/step][d][step], zero-padded; written in order, since scattered stores cost as much as the
 * products), so that vector lanes run over keys: a block of 4 query rows x 2 vectors of keys is accumulated in
 * registers (no horizontal sums), the 4 rows of logits are masked, exponentiated and normalised in
 * place in a small scratch, and added to the window mean. No [Hq, w, n] array is ever built. Keys may come as an
 * F16 cache's cells (k16): each whole block is transposed as 16-bit words (transpose.c's SSE2 tiles), then
 * converted in one pass (exactly, F16C where the CPU has it), instead of the whole cache being converted to
 * float32 first. With few query rows (a recall step's one query) building the blocks is most of the work: `perf`
 * put most of a step's votes in the element-by-element transpose of converted rows this replaced (docs/recall.md). */

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#endif

#include "kvlocal_kernels.h"

#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define KVL_TEMPLATE "window.inc"
#include "instances.h"

int kvl_window_votes_f32(const float * q, const int * q_pos, int n_head, int w,
                         const float * k, const unsigned short * k16, const int * pos, const float * bias, int n_kv,
                         int n, int d, float * out) {
    if (n_head <= 0 || n_kv <= 0 || n_head % n_kv != 0 || w < 0 || n < 0 || d <= 0 || (!k == !k16)) {
        return -1;
    }
    if (w == 0 || n == 0) {
        memset(out, 0, sizeof(float) * (size_t) n_head * (size_t) n);
        return 0;
    }
#if KVL_X86_DISPATCH
    switch (kvl_simd_active()) {
        case 2: return window_votes_avx512(q, q_pos, n_head, w, k, k16, pos, bias, n_kv, n, d, out);
        case 1: return window_votes_avx2(q, q_pos, n_head, w, k, k16, pos, bias, n_kv, n, d, out);
        default: break;
    }
#endif
    return window_votes_generic(q, q_pos, n_head, w, k, k16, pos, bias, n_kv, n, d, out);
}
