/* Top-k selection: the k largest of a row, marked (kvl_top_marked) or listed in index order (kvl_topk_f32).
 *
 * Each value becomes one 64-bit key: its float's rank as an unsigned integer in the high half, its tie rank
 * in the low half. The keys are then distinct, and a quickselect (median-of-three pivots, O(n) on average)
 * puts the k largest first: no comparison function, no heap. Every selection of the scorers goes through
 * here (the numpy steps' top_cells and kvl_attention_keep's), so their kept cells agree by construction. */

#include "kvlocal_kernels.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long key_t;

/* a float's rank as an unsigned integer: larger float, larger key; -0 as +0; NaN below everything */
static unsigned float_key(float f) {
    unsigned u;
    if (f != f) {
        return 0;
    }
    if (f == 0.0f) {
        f = 0.0f;
    }
    memcpy(&u, &f, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* the k-th largest of a[0..n) (distinct keys) moved to a[k-1], the larger ones before it */
static void select_largest(key_t * a, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int   mid = lo + (hi - lo) / 2;
        const key_t x = a[mid], y = a[lo], z = a[hi];
        const key_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                const key_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (k - 1 <= j) {
            hi = j;
        } else if (k - 1 >= i) {
            lo = i;
        } else {
            return;
        }
    }
}

void kvl_top_marked(const float * x, const int * order, int n, int k, unsigned long long * keys, unsigned char * mark) {
    memset(mark, 0, (size_t) (n > 0 ? n : 0));
    k = k < n ? k : n;
    if (k <= 0) {
        return;
    }
    for (int i = 0; i < n; i++) {
        keys[i] = (key_t) float_key(x[order ? order[i] : i]) << 32 | (unsigned) (n - 1 - i);
    }
    if (k < n) {
        select_largest(keys, n, k);
    }
    for (int i = 0; i < k; i++) {
        const int r = n - 1 - (int) (keys[i] & 0xffffffffu);
        mark[order ? order[r] : r] = 1;
    }
}

int kvl_topk_f32(const float * src, int n_rows, int n, int k, int * idx) {
    if (k < 0 || k > n) {
        return -1;
    }
    if (k == 0 || n_rows <= 0) {
        return 0;
    }
    key_t         * keys = malloc(sizeof(key_t) * (size_t) n);
    unsigned char * mark = malloc((size_t) n);
    if (!keys || !mark) {
        free(keys);
        free(mark);
        return -1;
    }
    for (int r = 0; r < n_rows; r++) {
        int * out = idx + (ptrdiff_t) r * k;
        kvl_top_marked(src + (ptrdiff_t) r * n, NULL, n, k, keys, mark);
        for (int i = 0, j = 0; i < n; i++) {
            if (mark[i]) {
                out[j++] = i;
            }
        }
    }
    free(keys);
    free(mark);
    return 0;
}
