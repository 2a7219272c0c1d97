#include "kvlocal_kernels.h"

#include <stdlib.h>

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

/* sift-down in a min-heap of the current k best (root = the worst of them) */
static void sift_down(int * heap, int k, int i, const float * x) {
    for (;;) {
        int worst = i;
        const int l = 2 * i + 1;
        const int r = l + 1;
        if (l < k && ranks_before(x[heap[worst]], heap[worst], x[heap[l]], heap[l])) {
            worst = l;
        }
        if (r < k && ranks_before(x[heap[worst]], heap[worst], x[heap[r]], heap[r])) {
            worst = r;
        }
        if (worst == i) {
            return;
        }
        const int t = heap[i];
        heap[i] = heap[worst];
        heap[worst] = t;
        i = worst;
    }
}

static int cmp_int(const void * a, const void * b) {
    return *(const int *) a - *(const int *) b;
}

int kvl_topk_f32(const float * src, int n_rows, int n, int k, int * idx) {
    if (k < 0 || k > n) {
        return -1;
    }
    for (int r = 0; r < n_rows; r++) {
        const float * x    = src + (long) r * n;
        int         * heap = idx + (long) r * k;
        if (k == 0) {
            continue;
        }
        for (int i = 0; i < k; i++) {
            heap[i] = i;
        }
        for (int i = k / 2 - 1; i >= 0; i--) {
            sift_down(heap, k, i, x);
        }
        for (int i = k; i < n; i++) {
            if (ranks_before(x[i], i, x[heap[0]], heap[0])) {
                heap[0] = i;
                sift_down(heap, k, 0, x);
            }
        }
        qsort(heap, k, sizeof(int), cmp_int);
    }
    return 0;
}
