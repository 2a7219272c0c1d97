#include "kvlocal_kernels.h"

#include <stddef.h>

/* max over the window of j, clipped to the row: the edges element by element, the interior as `kernel`
 * shifted passes over the row (each a vectorizable loop of maxima) */
static float max_at(const float * x, int n, int half, int j) {
    const int a = j - half < 0 ? 0 : j - half, b = j + half > n - 1 ? n - 1 : j + half;
    float m = x[a];
    for (int i = a + 1; i <= b; i++) {
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

static void max_row(const float * x, float * y, int n, int half) {
    const int lo = half < n ? half : n, hi = n - half > lo ? n - half : lo; /* interior: [lo, hi) */
    for (int j = 0; j < lo; j++) {
        y[j] = max_at(x, n, half, j);
    }
    for (int j = hi; j < n; j++) {
        y[j] = max_at(x, n, half, j);
    }
    for (int j = lo; j < hi; j++) {
        y[j] = x[j - half];
    }
    for (int s = 1 - half; s <= half; s++) {
        const float * xs = x + s;
        for (int j = lo; j < hi; j++) {
            y[j] = xs[j] > y[j] ? xs[j] : y[j];
        }
    }
}

void kvl_pool1d_f32(const float * src, float * dst, int n_rows, int n, int kernel, int kind) {
    const int half = kernel / 2;
    for (int r = 0; r < n_rows; r++) {
        const float * x = src + (ptrdiff_t) r * n;
        float       * y = dst + (ptrdiff_t) r * n;
        if (kind == 0) {
            max_row(x, y, n, half);
            continue;
        }
        for (int j = 0; j < n; j++) {
            const int lo = j - half < 0     ? 0     : j - half;
            const int hi = j + half > n - 1 ? n - 1 : j + half;
            float s = 0.0f;
            for (int i = lo; i <= hi; i++) {
                s += x[i];
            }
            y[j] = s / (float) kernel;
        }
    }
}
