/* One layer's kept cells under SnapKV, or CriticalKV over SnapKV, in one call (kvl_attention_keep).
 *
 * The scorers in kvlocal/compress are written in numpy, a few dozen array operations per layer and KV
 * head around the kernels of window.c, vnorm.c, pool.c and topk.c. At the sizes of an event (a few
 * KV heads of a few thousand cells) those operations cost more than the arithmetic; this file runs
 * the same steps, in the same order and with the same kernels, so its kept cells are the scorers'
 * (tests/kernels/test_kernels.py checks them on random layers against the numpy path). Per KV head:
 *
 *   1. the cells in position order (stable), the live ones (pos >= 0), the protected ones (sinks
 *      below n_sink, and the observation window: pos >= min(q_pos), or the `recent` latest);
 *   2. SnapKV: each query head's window votes over the live cells outside the window, in position
 *      order, pooled (kernel, max or avg), summed over the group's heads in order and divided by G;
 *      protected cells +inf, empty rows -inf;
 *   3. CriticalKV (vnorm given): stage 1 the top int(alpha * b) by that score, stage 2 ranks the rest
 *      by (score + eps) * ||v W_O||_p (p = 1, or 2), the norms computed where vnorm[] is NaN (and written there) —
 *      and, if 1 to AHEAD_BELOW are, those of the rows stage 1 and the window hold (not the sinks'):
 *      reading W_O, not the arithmetic, is what a few rows cost, and a later event that ranks them (a
 *      new question's stage 1 differs, the window moves) then finds their norms instead of reading
 *      W_O again for a few rows (a prefill event's chunk needs many: nothing ahead there);
 *   4. the top b (ties to the later position), in position order, right-aligned in `width` slots.
 *
 * The values come as float32 rows [n_kv][n][d], or (v16, v NULL) as an F16 cache's cells [n][n_kv][d], of which
 * only the rows that need a norm are converted: most of a recall swap's rows bring their norms along. The keys
 * likewise (k16, k NULL): the window votes convert them block by block as they read them. */

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off") /* (s + eps) * norm as numpy rounds it: two float operations */
#endif

#include "kvlocal_kernels.h"

#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* fewer rows than this, whose W_O read costs more than their arithmetic: compute ahead (step 3) */
#define AHEAD_BELOW 32

/* cells of one head in position order, stable (equal positions by index; empty rows, -1, first): order [n].
 * An LSD radix sort on pos + 1, 11 bits a pass; scratch [n] ints. */
static void position_order(const int * pos, int n, int * order, int * scratch) {
    unsigned top = 0;
    for (int j = 0; j < n; j++) {
        order[j] = j;
        top = (unsigned) (pos[j] + 1) > top ? (unsigned) (pos[j] + 1) : top;
    }
    int * src = order, * dst = scratch;
    for (int shift = 0; shift == 0 || (shift < 32 && top >> shift); shift += 11) {
        int count[2049] = { 0 };
        for (int j = 0; j < n; j++) {
            count[(((unsigned) (pos[src[j]] + 1)) >> shift & 2047) + 1]++;
        }
        for (int b = 0; b < 2048; b++) {
            count[b + 1] += count[b];
        }
        for (int j = 0; j < n; j++) {
            dst[count[((unsigned) (pos[src[j]] + 1)) >> shift & 2047]++] = src[j];
        }
        int * t = src;
        src = dst;
        dst = t;
    }
    if (src != order) {
        memcpy(order, src, sizeof(int) * (size_t) n);
    }
}

/* the norms of KV head g's rows[0..m) whose values are F16 cells v16 [n][n_kv][d]: converted (exactly) row by
 * row, only these, then as from float32 rows; out [m]. Returns 0, or -1 (out of memory). */
static int vnorm_f16_rows(const unsigned short * v16, int n_kv, int g, int d, const float * wo, int ld, int group,
                          int D, int p, const int * rows, int m, float * out) {
    float * vf = malloc(sizeof(float) * (size_t) m * d);
    if (!vf) {
        return -1;
    }
    for (int i = 0; i < m; i++) {
        kvl_f16_heads_f32(v16 + ((ptrdiff_t) rows[i] * n_kv + g) * d, 1, 1, d, vf + (ptrdiff_t) i * d);
    }
    const int rc = kvl_vnorm_f32(vf, m, d, wo, ld, group, D, p, NULL, m, out);
    free(vf);
    return rc;
}

int kvl_attention_keep(const float * votes, const float * q, const int * q_pos, int n_head, int w,
                       const float * k, const unsigned short * k16, const float * v, const unsigned short * v16,
                       const int * pos, const float * bias, int n_kv, int n, int d,
                       int n_sink, int recent, int kernel, int pool_kind,
                       const float * wo, int ld, int D, int norm_p, double alpha, float eps, float * vnorm,
                       const int * budget, int max_width, int * keep, int * width) {
    if (n_head <= 0 || n_kv <= 0 || n_head % n_kv != 0 || w < 0 || n < 0 || d <= 0 || kernel < 1 || kernel % 2 == 0 ||
        (!votes && (!q || !k == !k16)) || (wo && (ld < n_head * d || D <= 0 || (norm_p != 1 && norm_p != 2)))) {
        return -1;
    }
    const int group = n_head / n_kv;
    const int nn    = n > 0 ? n : 1;
    float   * own   = votes ? NULL : malloc(sizeof(float) * (size_t) n_head * nn);
    int     * keys  = malloc(sizeof(int) * (size_t) nn);           /* the sort's scratch */
    int     * order = malloc(sizeof(int) * (size_t) nn * 2);   /* ascending, then descending (live) positions */
    int     * rows  = malloc(sizeof(int) * (size_t) nn);       /* pooled rows, then rows without a norm */
    unsigned long long * rank = malloc(sizeof(unsigned long long) * (size_t) nn);  /* the selections' keys */
    float   * buf   = malloc(sizeof(float) * (size_t) nn * (2 * group + 3));
    unsigned char * flag = malloc((size_t) nn * 3);
    int rc = 0;
    if ((!votes && !own) || !keys || !order || !rows || !rank || !buf || !flag) {
        rc = -1;
        goto done;
    }
    if (!votes) {
        if (kvl_window_votes_f32(q, q_pos, n_head, w, k, k16, pos, bias, n_kv, n, d, own) != 0) {
            rc = -1;
            goto done;
        }
        votes = own;
    }
    int q_min = INT32_MAX;
    for (int i = 0; i < w; i++) {
        q_min = q_pos[i] < q_min ? q_pos[i] : q_min;
    }
    int * desc = order + nn;
    float * x = buf, * y = buf + (size_t) nn * group, * score = buf + (size_t) nn * 2 * group;
    float * crit = score + nn, * scratch = crit + nn;
    unsigned char * protect = flag, * first = flag + nn, * mark = flag + 2 * nn;
    int widest = 0;
    for (int g = 0; g < n_kv && rc == 0; g++) {
        const int * p = pos + (ptrdiff_t) g * n;
        position_order(p, n, order, keys);
        int lo = INT32_MAX; /* the observation window: live cells at lo or later */
        if (recent >= 0) {
            lo = recent > 0 && n > 0 ? p[order[n - recent > 0 ? n - recent : 0]] : INT32_MAX;
        } else if (w > 0) {
            lo = q_min;
        }
        int n_live = 0, m = 0;
        for (int j = 0; j < n; j++) {
            const int c = order[j], live = p[c] >= 0;
            n_live += live;
            protect[c] = live && (p[c] < n_sink || p[c] >= lo);
            if (live && p[c] < lo) {
                rows[m++] = c; /* outside the window: pooled, in position order */
            }
        }
        for (int j = 0; j < n_live; j++) {
            desc[j] = order[n - 1 - j];
        }
        for (int j = n_live; j < n; j++) {
            desc[j] = order[j - n_live];
        }
        /* SnapKV */
        for (int c = 0; c < n; c++) {
            score[c] = -INFINITY;
        }
        if (m > 0) {
            for (int h = 0; h < group; h++) {
                const float * vh = votes + (ptrdiff_t) (g * group + h) * n;
                for (int j = 0; j < m; j++) {
                    x[(ptrdiff_t) h * m + j] = vh[rows[j]];
                }
            }
            kvl_pool1d_f32(x, y, group, m, kernel, pool_kind);
            for (int j = 0; j < m; j++) {
                float s = y[j];
                for (int h = 1; h < group; h++) {
                    s += y[(ptrdiff_t) h * m + j];
                }
                score[rows[j]] = s / (float) group;
            }
        }
        for (int c = 0; c < n; c++) {
            if (protect[c]) {
                score[c] = INFINITY;
            }
        }
        const int b = budget[g] < 0 ? 0 : budget[g] < n_live ? budget[g] : n_live;
        const float * ranking = score;
        /* CriticalKV */
        if (vnorm) {
            float * vn = vnorm + (ptrdiff_t) g * n;
            kvl_top_marked(score, desc, n, (int) (alpha * (double) b), rank, first);
            int todo = 0;
            for (int c = 0; c < n; c++) {
                if (!first[c] && isfinite(score[c]) && isnan(vn[c])) {
                    rows[todo++] = c;
                }
            }
            if (todo > 0) {
                const int ahead = todo <= AHEAD_BELOW; /* a few rows: those a later event may rank too */
                for (int c = 0; ahead && c < n; c++) {
                    if (p[c] >= n_sink && isnan(vn[c]) && (first[c] || score[c] == INFINITY)) {
                        rows[todo++] = c;
                    }
                }
                if ((!v && !v16) || !wo) {
                    rc = -2;
                    break;
                }
                const float * wg = wo + (ptrdiff_t) g * group * d;
                if (v ? kvl_vnorm_f32(v + (ptrdiff_t) g * n * d, n, d, wg, ld, group, D, norm_p, rows, todo, scratch)
                      : vnorm_f16_rows(v16, n_kv, g, d, wg, ld, group, D, norm_p, rows, todo, scratch)) {
                    rc = -1;
                    break;
                }
                for (int i = 0; i < todo; i++) {
                    vn[rows[i]] = scratch[i];
                }
            }
            for (int c = 0; c < n; c++) {
                crit[c] = first[c] ? INFINITY : isfinite(score[c]) ? (score[c] + eps) * vn[c] : score[c];
            }
            ranking = crit;
        }
        if (b > max_width) {
            rc = -1;
            break;
        }
        kvl_top_marked(ranking, desc, n, b, rank, mark);
        int * out = keep + (ptrdiff_t) g * max_width;
        for (int i = 0; i < max_width - b; i++) {
            out[i] = -1;
        }
        for (int j = 0, i = max_width - b; j < n; j++) {
            if (mark[order[j]]) {
                out[i++] = order[j];
            }
        }
        widest = b > widest ? b : widest;
    }
    *width = widest;
done:
    free(own); free(keys); free(order); free(rows); free(rank); free(buf); free(flag);
    return rc;
}
