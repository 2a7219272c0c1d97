/* The recall tier's candidate pages for a question (kvlocal/recall/select.py, choose_candidates): one call
 * per KV head instead of two dozen numpy operations, which at a swap's sizes (a hundred pages, a few queries)
 * cost more than the arithmetic — 90 heads a swap on SmolLM2.
 *
 * A page's bound is Quest's: for each query the largest q.k any key within the page's element-wise
 * [kmin, kmax] box can reach, sum_i max(q_i kmin_i, q_i kmax_i); the page's is the largest over the queries.
 * Pages holding a row off the device are ranked by bound (ties to the lower page) and taken until they hold
 * n_want such rows; their off-device rows are listed in page order. */

#include "kvlocal_kernels.h"

#include <math.h>
#include <stdlib.h>

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
    if (!off || !rank) {
        free(off);
        free(rank);
        return -1;
    }
    int n_ranked = 0;
    for (int p = 0; p < n_pages; p++) {
        off[p] = 0;
        for (int r = p * page; r < n && r < (p + 1) * page; r++) {
            off[p] += !on_device[r];
        }
        if (off[p] == 0) {
            continue; /* every row on the device: nothing to offer */
        }
        const float * lo = kmin + (long long) p * d, * hi = kmax + (long long) p * d;
        float best = -INFINITY;
        for (int j = 0; j < m; j++) {
            const float * qj = q + (long long) j * d;
            float s = 0.0f;
            for (int i = 0; i < d; i++) {
                s += qj[i] >= 0.0f ? qj[i] * hi[i] : qj[i] * lo[i];
            }
            best = s > best ? s : best;
        }
        rank[n_ranked].bound = m > 0 ? best : 0.0f;
        rank[n_ranked++].page = p;
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
    return count;
}
