#include "kvlocal_kernels.h"

#include <stdlib.h>
#include <string.h>

/* "a ranks before b": larger value first, NaN last, lower index first on ties */
static int ranks_before(float va, int ia, float vb, int ib) {
    const int na = va != va;
    const int nb = vb != vb;
    if (na != nb) {
        return nb;
    }
    if (!na && va != vb) {
        return va > vb;
    }
    return ia < ib;
}

/* sift-down in a heap of selected indices whose root is the one nearest the boundary of the selection:
 * the worst of the k best (worst = 0), or the best of the m worst (worst = 1) */
static void sift_down(int * heap, int k, int i, const float * x, int worst) {
    for (;;) {
        int edge = i;
        const int l = 2 * i + 1;
        const int r = l + 1;
        for (int c = l; c <= r && c < k; c++) {
            const int nearer = worst ? ranks_before(x[heap[c]], heap[c], x[heap[edge]], heap[edge])
                                     : ranks_before(x[heap[edge]], heap[edge], x[heap[c]], heap[c]);
            if (nearer) {
                edge = c;
            }
        }
        if (edge == i) {
            return;
        }
        const int t = heap[i];
        heap[i] = heap[edge];
        heap[edge] = t;
        i = edge;
    }
}

/* the m indices of x[0..n) nearest one end of the ranking (the m best, or with worst = 1 the m worst)
 * into heap [m], by a heap over the first m and one pass over the rest */
static void select_heap(const float * x, int n, int m, int * heap, int worst) {
    if (m == 0) {
        return;
    }
    for (int i = 0; i < m; i++) {
        heap[i] = i;
    }
    for (int i = m / 2 - 1; i >= 0; i--) {
        sift_down(heap, m, i, x, worst);
    }
    for (int i = m; i < n; i++) {
        const int in = worst ? ranks_before(x[heap[0]], heap[0], x[i], i) : ranks_before(x[i], i, x[heap[0]], heap[0]);
        if (in) {
            heap[0] = i;
            sift_down(heap, m, 0, x, worst);
        }
    }
}

int kvl_topk_f32(const float * src, int n_rows, int n, int k, int * idx) {
    if (k < 0 || k > n) {
        return -1;
    }
    if (k == 0 || n_rows <= 0) {
        return 0;
    }
    /* keeping most of a row (a budget's usual case) selects the few it drops; either way the chosen
     * indices are marked and read back in increasing order (no sort) */
    const int      worst = n - k < k;
    const int      m     = worst ? n - k : k;
    unsigned char * mark = malloc((size_t) n);
    int           * heap = malloc(sizeof(int) * (size_t) (m > 0 ? m : 1));
    if (!mark || !heap) {
        free(mark);
        free(heap);
        return -1;
    }
    for (int r = 0; r < n_rows; r++) {
        const float * x = src + (long) r * n;
        int         * out = idx + (long) r * k;
        memset(mark, worst, (size_t) n);
        select_heap(x, n, m, heap, worst);
        for (int i = 0; i < m; i++) {
            mark[heap[i]] = (unsigned char) !worst;
        }
        for (int i = 0, j = 0; i < n; i++) {
            if (mark[i]) {
                out[j++] = i;
            }
        }
    }
    free(mark);
    free(heap);
    return 0;
}
