/* The recall tier's pages: their key boxes as rows join a head's store (kvl_page_boxes, at the end), and the
 * candidate pages for a question (kvlocal/recall/select.py, choose_candidates): one call
 * per KV head instead of two dozen numpy operations, which at a swap's sizes (a hundred pages, a few queries)
 * cost more than the arithmetic — 90 heads a swap on SmolLM2.
 *
 * A page's bound is Quest's: for each query the largest q.k any key within the page's element-wise
 * [kmin, kmax] box can reach, sum_i max(q_i kmin_i, q_i kmax_i); the page's is the largest over the queries.
 * Pages holding a row off the device are ranked by bound (ties to the lower page) and taken until they hold
 * n_want such rows; their off-device rows are listed in page order.
 *
 * The bounds are the arithmetic (a question's window of queries x every page, per head): the boxes are
 * transposed once per call so that vector lanes run over pages (pages.inc), one instance per instruction
 * set as in window.c. */

#include "kvlocal_kernels.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define KVL_TEMPLATE "pages.inc"
#include "instances.h"

#define PADDED(n_pages) (((n_pages) + 31) / 32 * 32) /* a whole register block of pages at the widest vectors */

/* bound[p] for pages 0..n_pages-1 (0 without queries; bound holds PADDED(n_pages)); -1 out of memory */
static int page_bounds(const float * q, int m, int d, const float * kmin, const float * kmax, int n_pages,
                       float * bound) {
    if (m == 0 || n_pages == 0) {
        for (int p = 0; p < n_pages; p++) {
            bound[p] = 0.0f;
        }
        return 0;
    }
    const int ld  = PADDED(n_pages);
    float *   loT = calloc((size_t) d * ld * 2, sizeof(float));
    if (!loT) {
        return -1;
    }
    float * hiT = loT + (size_t) d * ld;
    for (int i = 0; i < d; i++) { /* written in order: strided stores would stall on every page */
        for (int p = 0; p < n_pages; p++) {
            loT[(size_t) i * ld + p] = kmin[(size_t) p * d + i];
            hiT[(size_t) i * ld + p] = kmax[(size_t) p * d + i];
        }
    }
#if KVL_X86_DISPATCH
    switch (kvl_simd_active()) {
        case 2: page_bounds_avx512(q, m, d, loT, hiT, ld, bound); break;
        case 1: page_bounds_avx2(q, m, d, loT, hiT, ld, bound); break;
        default: page_bounds_generic(q, m, d, loT, hiT, ld, bound); break;
    }
#else
    page_bounds_generic(q, m, d, loT, hiT, ld, bound);
#endif
    free(loT);
    return 0;
}

typedef struct {
    float bound;
    int   page;
} ranked_t;

static int by_bound(const void * a, const void * b) {
    const ranked_t * x = a, * y = b;
    if (x->bound != y->bound) {
        return x->bound > y->bound ? -1 : 1;
    }
    return (x->page > y->page) - (x->page < y->page);
}

int kvl_page_candidates(const float * q, int m, int d, const float * kmin, const float * kmax, int n, int page,
                        const unsigned char * on_device, long long n_want, int * out) {
    if (m < 0 || d <= 0 || n < 0 || page <= 0) {
        return -1;
    }
    const int  n_pages = (n + page - 1) / page;
    int      * off     = malloc(sizeof(int) * (size_t) (n_pages > 0 ? n_pages : 1));
    ranked_t * rank    = malloc(sizeof(ranked_t) * (size_t) (n_pages > 0 ? n_pages : 1));
    float    * bound   = malloc(sizeof(float) * (size_t) PADDED(n_pages > 0 ? n_pages : 1));
    if (!off || !rank || !bound) {
        free(off);
        free(rank);
        free(bound);
        return -1;
    }
    if (page_bounds(q, m, d, kmin, kmax, n_pages, bound) != 0) {
        free(off);
        free(rank);
        free(bound);
        return -1;
    }
    int n_ranked = 0;
    for (int p = 0; p < n_pages; p++) {
        off[p] = 0;
        for (int r = p * page; r < n && r < (p + 1) * page; r++) {
            off[p] += !on_device[r];
        }
        if (off[p] > 0) { /* a page with every row on the device has nothing to offer */
            rank[n_ranked].bound  = bound[p];
            rank[n_ranked++].page = p;
        }
    }
    qsort(rank, (size_t) n_ranked, sizeof(ranked_t), by_bound);
    long long have = 0;
    for (int i = 0; i < n_ranked; i++) {
        off[rank[i].page] = -off[rank[i].page]; /* taken: marked by its sign */
        have -= off[rank[i].page];
        if (have >= n_want) {
            break;
        }
    }
    int count = 0;
    for (int p = 0; p < n_pages; p++) {
        for (int r = p * page; off[p] < 0 && r < n && r < (p + 1) * page; r++) {
            if (!on_device[r]) {
                out[count++] = r;
            }
        }
    }
    free(off);
    free(rank);
    free(bound);
    return count;
}

/* min/max that keep a NaN as numpy's np.minimum/np.maximum do (the boxes then match the numpy steps bit for bit) */
static inline float lesser(float x, float lo) {
    return (x < lo || x != x) ? x : lo;
}

static inline float greater(float x, float hi) {
    return (x > hi || x != x) ? x : hi;
}

int kvl_page_boxes(const float * keys, long long m, int d, long long first, int page, float * kmin, float * kmax) {
    if (m < 0 || d <= 0 || first < 0 || page <= 0) {
        return -1;
    }
    for (long long r = 0; r < m; r++) {
        const long long row = first + r;
        float *         lo  = kmin + (row / page) * d;
        float *         hi  = kmax + (row / page) * d;
        const float *   k   = keys + r * d;
        if (row % page == 0) { /* a page's first row: its box starts here */
            memcpy(lo, k, sizeof(float) * (size_t) d);
            memcpy(hi, k, sizeof(float) * (size_t) d);
            continue;
        }
        for (int i = 0; i < d; i++) {
            lo[i] = lesser(k[i], lo[i]);
            hi[i] = greater(k[i], hi[i]);
        }
    }
    return 0;
}
